/* AdamW on lean host state: bf16 master weights, bf16 or 8-bit moments. Built with adamw_kernels.c.

   One call updates a range of blocks of one group (<= 2048 values a block; with 8-bit moments a
   block never straddles two parameters). Per block one loop, specialised for the gradient, master
   and moment formats, decodes, updates and encodes each value: every host buffer streams through
   memory once, so the bytes moved are the formats' own. 8-bit moments take a second pass over a
   cache-resident scratch, because a block's scale (its absmax) is known only after its update.

   The arithmetic is written as separate multiplies and adds (built with -ffp-contract=off) so that
   `lean.py`'s plain-torch reference, one tensor operation per step here, is bitwise equal:
       m = m + w1 * (g - m);   v = v * beta2 + (value2 * g) * g
       p = p * decay;          p = p + (neg_step * m) / (sqrt(v) * inv_bias2_sqrt + eps)
   Encodings:
     bf16, stochastic   add 16 random bits to the fp32 pattern and truncate (unbiased rounding);
                        the bits hash (seed, element index): reproducible, any thread split
     bf16 + Kahan       hi = round(p), lo = round(p - hi): the pair keeps ~16 bits of mantissa
     8-bit dynamic      dynamic tree quantization of x = |value| / absmax(block), as in 8-bit Adam
                        but with decades of 16x (binade-aligned, so codes come from float bits):
                        decade d covers [16^-(d+1), 16^-d) in 2^(B-1-d) equal bins, and a code's
                        leading one says its decade, the bits below it the bin (B = 7 magnitude
                        bits + sign for m, 8 for v); a code decodes to its bin's centre. x below
                        the last decade is 0, except that a positive v keeps the smallest code. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")  /* measured ~20% faster here than gcc's default 256 */
#endif

#define QB 2048
#define FRAC 1.06666672229766845703125f    /* 16/15 in fp32: decade fraction from [1/16, 1) to [0, 1) */
#define UNFRAC 0.9375f                      /* 15/16 */

typedef struct {
  void* p; void* comp; void* m; void* v; float* m_scale; float* v_scale; const int64_t* starts;
  const void* g; void* out;
  int32_t master_kind, moments_kind, grad_kind, out_kind; /* master 0 fp32 1 bf16 2 kahan; moments 0 fp32 1 bf16 2 8-bit;
                                                              grad/out 0 fp32 1 bf16 2 fp16 */
  int64_t n;
  float decay, scale, w1, beta2, value2, inv_bias2_sqrt, eps, neg_step;
  uint32_t seed_p, seed_m, seed_v;
} LeanArgs;

#define INLINE static inline __attribute__((always_inline))
INLINE float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
INLINE uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint16_t f2bf(float f) { uint32_t u = bits(f); uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? (uint16_t)0x7FC0 : r; }
INLINE uint32_t mix32(uint32_t x) { x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16; return x; }
INLINE uint16_t f2bf_sr(float f, uint32_t index, uint32_t seed) {
  uint16_t r = (uint16_t)((bits(f) + (mix32(index ^ seed) & 0xFFFFu)) >> 16);
  return f != f ? (uint16_t)0x7FC0 : r;
}
INLINE float load1(const void* src, int kind, int64_t i) {
  return kind == 0 ? ((const float*)src)[i] : kind == 1 ? bf2f(((const uint16_t*)src)[i]) : (float)((const _Float16*)src)[i];
}

/* 8-bit dynamic codes: `magnitude` bits B, x in [0, 1]. */
INLINE uint32_t encode8(float x, int B, int keep_positive) {
  uint32_t raw = bits(x);
  int32_t d = (126 - (int32_t)(raw >> 23)) >> 2;               /* floor((-1 - log2 x) / 4) */
  d = d < 0 ? 0 : (d > B ? B : d);                              /* x == 1 falls in decade 0 */
  float u = from_bits(raw + ((uint32_t)d << 25));               /* x * 16^d, exact */
  float y = ((u - 0.0625f) * FRAC + 1.0f) * from_bits((uint32_t)(126 + B - d) << 23);  /* in [2^t, 2^(t+1)), t = B-1-d */
  int32_t code = (int32_t)y, most = (1 << B) - 1;
  code = code > most ? most : code;
  uint32_t below = keep_positive && x > 0.0f ? 1u : 0u;
  return d >= B || x == 0.0f ? below : (uint32_t)code;
}

INLINE float decode8(uint32_t code, int B) {
  int32_t top = (int32_t)(bits((float)(code | 1u)) >> 23) - 127;   /* leading one: the decade is B-1-top */
  float t = ((float)code + 0.5f) * from_bits((uint32_t)(127 - top) << 23) - 1.0f;   /* (bin + 1/2) / 2^top */
  float u = t * UNFRAC + 0.0625f;
  float x = from_bits(bits(u) - ((uint32_t)(B - 1 - top) << 25));   /* u / 16^d, exact */
  return code == 0 ? 0.0f : x;
}

/* One block: decode, update, encode. GK, MK, VK are compile-time constants at each call site. */
INLINE void block(const LeanArgs* a, int64_t o, int k, int64_t b, float* restrict sm, float* restrict sv,
                  const int GK, const int MK, const int VK) {
  float* P32 = (float*)a->p + o; uint16_t* P16 = (uint16_t*)a->p + o; uint16_t* C16 = (uint16_t*)a->comp + o;
  float* M32 = (float*)a->m + o; float* V32 = (float*)a->v + o;
  uint16_t* M16 = (uint16_t*)a->m + o; uint16_t* V16 = (uint16_t*)a->v + o;
  const uint8_t* M8 = (const uint8_t*)a->m + o; const uint8_t* V8 = (const uint8_t*)a->v + o;
  const float am = VK == 2 ? a->m_scale[b] : 0.0f, av = VK == 2 ? a->v_scale[b] : 0.0f;
  for (int i = 0; i < k; i++) {
    float g = load1(a->g, GK, o + i) * a->scale;
    float p = MK == 0 ? P32[i] : MK == 1 ? bf2f(P16[i]) : bf2f(P16[i]) + bf2f(C16[i]);
    float m, v;
    if (VK == 0) { m = M32[i]; v = V32[i]; }
    else if (VK == 1) { m = bf2f(M16[i]); v = bf2f(V16[i]); }
    else { m = from_bits(bits(decode8(M8[i] & 0x7Fu, 7) * am) | ((uint32_t)(M8[i] & 0x80u) << 24)); v = decode8(V8[i], 8) * av; }
    p = p * a->decay;
    m = m + a->w1 * (g - m);
    v = v * a->beta2 + (a->value2 * g) * g;
    p = p + (a->neg_step * m) / (sqrtf(v) * a->inv_bias2_sqrt + a->eps);
    uint32_t index = (uint32_t)(o + i);
    if (MK == 0) P32[i] = p;
    else if (MK == 1) P16[i] = f2bf_sr(p, index, a->seed_p);
    else { uint16_t hi = f2bf(p); P16[i] = hi; C16[i] = f2bf(p - bf2f(hi)); }
    if (VK == 0) { M32[i] = m; V32[i] = v; }
    else if (VK == 1) { M16[i] = f2bf_sr(m, index, a->seed_m); V16[i] = f2bf_sr(v, index, a->seed_v); }
    else { sm[i] = m; sv[i] = v; }
  }
}

static void store_out(const LeanArgs* a, int64_t o, int k) {
  /* The compute copy from what the master now holds (what is stored is what computes). */
  for (int i = 0; i < k; i++) {
    float p = a->master_kind == 0 ? ((const float*)a->p)[o + i] : bf2f(((const uint16_t*)a->p)[o + i]);
    if (a->master_kind == 2) p = p + bf2f(((const uint16_t*)a->comp)[o + i]);
    if (a->out_kind == 0) ((float*)a->out)[o + i] = p;
    else if (a->out_kind == 1) ((uint16_t*)a->out)[o + i] = f2bf(p);
    else ((_Float16*)a->out)[o + i] = (_Float16)p;
  }
}

static float quantize(const float* restrict src, int k, int B, int sign, uint8_t* restrict codes) {
  uint32_t top_bits = 0;  /* max |value| on the bit patterns: same order for finite values, and it vectorizes */
  for (int i = 0; i < k; i++) { uint32_t u = bits(src[i]) & 0x7FFFFFFFu; top_bits = u > top_bits ? u : top_bits; }
  float amax = from_bits(top_bits), r = amax > 0.0f ? 1.0f / amax : 0.0f;
  for (int i = 0; i < k; i++) {
    uint32_t code = encode8(fabsf(src[i]) * r, B, !sign);
    codes[i] = (uint8_t)(sign && code ? code | ((bits(src[i]) >> 24) & 0x80u) : code);
  }
  return amax;
}

#define CASE(GK, MK, VK) case (GK) * 9 + (MK) * 3 + (VK): block(a, o, k, b, sm, sv, GK, MK, VK); break;
#define CASES(GK, MK) CASE(GK, MK, 0) CASE(GK, MK, 1) CASE(GK, MK, 2)
#define ALL(GK) CASES(GK, 0) CASES(GK, 1) CASES(GK, 2)

/* Blocks [first, last): from `starts` when given, else fixed blocks of QB values. */
void lean_update(const LeanArgs* a, int64_t first, int64_t last) {
  float sm[QB], sv[QB];
  const int key = a->grad_kind * 9 + a->master_kind * 3 + a->moments_kind;
  for (int64_t b = first; b < last; b++) {
    int64_t o = a->starts ? a->starts[b] : b * QB;
    int64_t end = a->starts ? a->starts[b + 1] : (o + QB < a->n ? o + QB : a->n);
    int k = (int)(end - o);
    switch (key) { ALL(0) ALL(1) ALL(2) default: return; }
    if (a->out) store_out(a, o, k);
    if (a->moments_kind == 2) {
      a->m_scale[b] = quantize(sm, k, 7, 1, (uint8_t*)a->m + o);
      a->v_scale[b] = quantize(sv, k, 8, 0, (uint8_t*)a->v + o);
    }
  }
}

/* The bandwidth floor for a byte count: the same streams as an update, in blocks of QB values,
   with no arithmetic. mode 0: read, 1: read and write back, 2: write only; widths in bytes/value. */
void lean_floor(void** streams, const int32_t* widths, const int32_t* modes, int32_t count, int64_t n) {
  uint64_t t = 0;
  for (int64_t o = 0; o < n; o += QB) {
    int64_t k = o + QB < n ? QB : n - o;
    for (int32_t s = 0; s < count; s++) {
      uint64_t* base = (uint64_t*)((uint8_t*)streams[s] + o * widths[s]);
      int64_t words = k * widths[s] / 8;
      if (modes[s] == 0) { for (int64_t i = 0; i < words; i++) t ^= base[i]; }
      else if (modes[s] == 1) { for (int64_t i = 0; i < words; i++) base[i] += 1; }
      else { for (int64_t i = 0; i < words; i++) base[i] = (uint64_t)i; }
    }
  }
  volatile uint64_t sink = t; (void)sink;
}
