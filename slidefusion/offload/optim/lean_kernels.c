/* AdamW on lean host state: bf16 master weights, bf16 or 8-bit moments. Built with adamw_kernels.c.

   One call updates a range of blocks of one group (<= 2048 values a block; with 8-bit moments a
   block never straddles two parameters). Per block one loop, specialised for the gradient, master
   and moment formats, decodes, updates and encodes each value: every host buffer streams through
   memory once, so the bytes moved are the formats' own. The loops are branch-free over restrict
   pointers with the constants in registers, and gcc vectorizes every one of them (one value per
   SIMD lane; -fopt-info-vec). 8-bit moments take a second pass over a cache-resident scratch,
   because a block's scale (its absmax, taken in the update loop) is known only after its update.
   How close they come to a bandwidth floor that moves each stream alone is measured by
   benchmarks/offload.py, what each term costs (division and square root, hash, 8-bit codec) by
   benchmarks/offload_terms.py; the results are in the README.

   The arithmetic is written as separate multiplies and adds (built with -ffp-contract=off) so that
   `lean.py`'s plain-torch reference, one tensor operation per step here, is bitwise equal:
       m = m + w1 * (g - m);   v = v * beta2 + (value2 * g) * g
       p = p * decay;          p = p + (neg_step * m) / (sqrt(v) * inv_bias2_sqrt + eps)
   Encodings:
     bf16, stochastic   add 16 random bits to the fp32 pattern and truncate (unbiased rounding);
                        the bits hash (seed, element index): reproducible, any thread split. The
                        master has its own hash; m and v take the low and high halves of one
                        (each half is uniform, so each rounding stays unbiased; one hash less
                        per value)
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
#pragma GCC target("prefer-vector-width=512")  /* faster here than gcc's default 256 (benchmarks/offload.py) */
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
  uint32_t seed_p, seed_m;  /* master, moments */
} LeanArgs;

#define INLINE static inline __attribute__((always_inline))
INLINE float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
INLINE uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint16_t f2bf(float f) { uint32_t u = bits(f); uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? (uint16_t)0x7FC0 : r; }
INLINE uint32_t mix32(uint32_t x) { x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16; return x; }
INLINE uint16_t f2bf_sr(float f, uint32_t noise) {  /* noise: 16 random bits */
  uint16_t r = (uint16_t)((bits(f) + noise) >> 16);
  return f != f ? (uint16_t)0x7FC0 : r;
}
/* 8-bit dynamic codes: `magnitude` bits B, x in [0, 1]. */
INLINE uint32_t encode8(float x, int B, int keep_positive) {
  uint32_t raw = bits(x);
  int32_t d = (126 - (int32_t)(raw >> 23)) >> 2;               /* floor((-1 - log2 x) / 4); x == 0: 31 */
  d = d < 0 ? 0 : (d > B ? B : d);                              /* x == 1 falls in decade 0 */
  float u = from_bits(raw + ((uint32_t)d << 25));               /* x * 16^d, exact */
  float z = (u - 0.0625f) * FRAC + 1.0f;                        /* in [1, 2]: the bin is z's top t+1 bits, t = B-1-d */
  /* trunc(z * 2^t) read off z's bits (one variable shift instead of a scale, a multiply and a
     conversion); equal to it on every float in [0, 1] (checked exhaustively). */
  int32_t code = (int32_t)((bits(z) - 0x3F000000u) >> (24 - B + d)), most = (1 << B) - 1;
  code = code > most ? most : code;
  uint32_t below = keep_positive && raw != 0 ? 1u : 0u;
  return d >= B ? below : (uint32_t)code;                       /* d == B: x == 0 or below the last decade */
}

INLINE float decode8(uint32_t code, int B) {
  int32_t top = (int32_t)(bits((float)(code | 1u)) >> 23) - 127;   /* leading one: the decade is B-1-top */
  float t = ((float)code + 0.5f) * from_bits((uint32_t)(127 - top) << 23) - 1.0f;   /* (bin + 1/2) / 2^top */
  float u = t * UNFRAC + 0.0625f;
  float x = from_bits(bits(u) - ((uint32_t)(B - 1 - top) << 25));   /* u / 16^d, exact */
  return code == 0 ? 0.0f : x;
}

/* The update's constants, copied out of LeanArgs so the loops hold them in registers (a store through
   a uint16_t* might otherwise alias them and stop vectorization). */
typedef struct { float decay, scale, w1, beta2, value2, ibs, eps, neg; uint32_t sp, sm; } Consts;

/* One block of k values at offset o: decode, update, encode. GK, MK, VK are compile-time constants at
   each call site, and every pointer is restrict, so each instance is one branch-free loop that gcc
   vectorizes (one value per SIMD lane). 8-bit moments leave m and v in the fp32 scratch sm, sv and
   return their absmax bit patterns in top[0..1], for the encoding pass. */
INLINE void block(const Consts c, int k, uint32_t index0, const void* restrict G, void* restrict P,
                  uint16_t* restrict C, void* restrict M, void* restrict V, float am, float av,
                  float* restrict sm, float* restrict sv, uint32_t* restrict top, const int GK, const int MK, const int VK) {
  const float* G32 = (const float*)G; const uint16_t* G16 = (const uint16_t*)G;
  float* P32 = (float*)P; uint16_t* P16 = (uint16_t*)P;
  float* M32 = (float*)M; float* V32 = (float*)V; uint16_t* M16 = (uint16_t*)M; uint16_t* V16 = (uint16_t*)V;
  const uint8_t* M8 = (const uint8_t*)M; const uint8_t* V8 = (const uint8_t*)V;
  uint32_t top_m = 0, top_v = 0;
  for (int i = 0; i < k; i++) {
    float g = (GK == 0 ? G32[i] : bf2f(G16[i])) * c.scale;
    float p = MK == 0 ? P32[i] : MK == 1 ? bf2f(P16[i]) : bf2f(P16[i]) + bf2f(C[i]);
    float m, v;
    if (VK == 0) { m = M32[i]; v = V32[i]; }
    else if (VK == 1) { m = bf2f(M16[i]); v = bf2f(V16[i]); }
    else { uint32_t cm = M8[i]; m = from_bits(bits(decode8(cm & 0x7Fu, 7) * am) | ((cm & 0x80u) << 24)); v = decode8(V8[i], 8) * av; }
    p = p * c.decay;
    m = m + c.w1 * (g - m);
    v = v * c.beta2 + (c.value2 * g) * g;
    p = p + (c.neg * m) / (sqrtf(v) * c.ibs + c.eps);
    uint32_t index = index0 + (uint32_t)i;
    if (MK == 0) P32[i] = p;
    else if (MK == 1) P16[i] = f2bf_sr(p, mix32(index ^ c.sp) & 0xFFFFu);
    else { uint16_t hi = f2bf(p); P16[i] = hi; C[i] = f2bf(p - bf2f(hi)); }
    if (VK == 0) { M32[i] = m; V32[i] = v; }
    else if (VK == 1) { uint32_t h = mix32(index ^ c.sm); M16[i] = f2bf_sr(m, h & 0xFFFFu); V16[i] = f2bf_sr(v, h >> 16); }
    else {
      sm[i] = m; sv[i] = v;
      uint32_t um = bits(m) & 0x7FFFFFFFu, uv = bits(v) & 0x7FFFFFFFu;  /* |value| on the bit patterns: same order */
      top_m = um > top_m ? um : top_m; top_v = uv > top_v ? uv : top_v;
    }
  }
  top[0] = top_m; top[1] = top_v;
}


/* The compute copy from what the master now holds (what is stored is what computes); one loop per
   format pair, chosen outside it. */
#define OUT_LOOP(GET, PUT) for (int i = 0; i < k; i++) { float p = GET; PUT; }
#define OUT_PUTS(GET) \
  if (a->out_kind == 0) { float* restrict O = (float*)a->out + o; OUT_LOOP(GET, O[i] = p) } \
  else if (a->out_kind == 1) { uint16_t* restrict O = (uint16_t*)a->out + o; OUT_LOOP(GET, O[i] = f2bf(p)) } \
  else { _Float16* restrict O = (_Float16*)a->out + o; OUT_LOOP(GET, O[i] = (_Float16)p) }
static void store_out(const LeanArgs* a, int64_t o, int k) {
  const float* restrict P32 = (const float*)a->p + o;
  const uint16_t* restrict P16 = (const uint16_t*)a->p + o; const uint16_t* restrict C16 = (const uint16_t*)a->comp + o;
  if (a->master_kind == 0) { OUT_PUTS(P32[i]) }
  else if (a->master_kind == 1) { OUT_PUTS(bf2f(P16[i])) }
  else { OUT_PUTS(bf2f(P16[i]) + bf2f(C16[i])) }
}

/* fp32 scratch -> 8-bit codes, against the block's absmax (found by the update loop). */
INLINE void encode_block(const float* restrict src, int k, float amax, int B, int sign, uint8_t* restrict codes) {
  float r = amax > 0.0f ? 1.0f / amax : 0.0f;
  for (int i = 0; i < k; i++) {
    uint32_t code = encode8(fabsf(src[i]) * r, B, !sign);
    codes[i] = (uint8_t)(sign && code ? code | ((bits(src[i]) >> 24) & 0x80u) : code);
  }
}

#define CASE(GK, MK, VK) case (GK) * 9 + (MK) * 3 + (VK): \
  block(c, k, (uint32_t)o, g, P, C, M, V, am, av, sm, sv, top, GK, MK, VK); break;
#define CASES(GK, MK) CASE(GK, MK, 0) CASE(GK, MK, 1) CASE(GK, MK, 2)
#define ALL(GK) CASES(GK, 0) CASES(GK, 1) CASES(GK, 2)

/* Blocks [first, last): from `starts` when given, else fixed blocks of QB values. fp16 gradients
   are widened into a scratch first (gcc 12 does not vectorize _Float16 loads), then read as fp32. */
void lean_update(const LeanArgs* a, int64_t first, int64_t last) {
  float sm[QB], sv[QB], g32[QB];
  uint32_t top[2] = {0, 0};
  const Consts c = {a->decay, a->scale, a->w1, a->beta2, a->value2, a->inv_bias2_sqrt, a->eps, a->neg_step,
                    a->seed_p, a->seed_m};
  const int gk = a->grad_kind == 2 ? 0 : a->grad_kind, key = gk * 9 + a->master_kind * 3 + a->moments_kind;
  const int pw = a->master_kind == 0 ? 4 : 2, mw = a->moments_kind == 0 ? 4 : a->moments_kind == 1 ? 2 : 1;
  for (int64_t b = first; b < last; b++) {
    int64_t o = a->starts ? a->starts[b] : b * QB;
    int64_t end = a->starts ? a->starts[b + 1] : (o + QB < a->n ? o + QB : a->n);
    int k = (int)(end - o);
    const void* g = (const char*)a->g + o * (a->grad_kind == 0 ? 4 : 2);
    if (a->grad_kind == 2) {
      for (int i = 0; i < k; i++) g32[i] = (float)((const _Float16*)g)[i];
      g = g32;
    }
    uint16_t* C = a->comp ? (uint16_t*)a->comp + o : NULL;
    const float am = a->moments_kind == 2 ? a->m_scale[b] : 0.0f, av = a->moments_kind == 2 ? a->v_scale[b] : 0.0f;
    void *P = (char*)a->p + o * pw, *M = (char*)a->m + o * mw, *V = (char*)a->v + o * mw;
    /* bf16 / bf16 used to run a loop over 32-bit word pairs (no 16-bit shuffles, faster in cache);
       with m and v sharing one hash that loop streamed from DRAM slower than this one
       (benchmarks/offload.py, alternating), so every format takes `block`. */
    switch (key) { ALL(0) ALL(1) default: return; }
    if (a->out) store_out(a, o, k);
    if (a->moments_kind == 2) {
      a->m_scale[b] = from_bits(top[0]);
      a->v_scale[b] = from_bits(top[1]);
      encode_block(sm, k, a->m_scale[b], 7, 1, (uint8_t*)a->m + o);
      encode_block(sv, k, a->v_scale[b], 8, 0, (uint8_t*)a->v + o);
    }
  }
}

/* lean_update over `parts` neighbouring ranges of blocks (edges[0..parts]) at once, on the OpenMP
   runtime's threads. torch's CPU build ships libgomp, and a process that has loaded it resolves this
   library's libgomp to the same one, so these are torch's own intra-op threads, already awake: the
   update of a compute thread running it in line (kernels.py builds without OpenMP where it cannot). */
#ifdef _OPENMP
void lean_update_ranges(const LeanArgs* a, const int64_t* edges, int32_t parts) {
  #pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int32_t i = 0; i < parts; i++) lean_update(a, edges[i], edges[i + 1]);
}
#endif

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
