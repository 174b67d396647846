/* AdamW on flat host buffers, built at first use by slidefusion/offload/kernels.py.

   Compiled with -ffp-contract=off so every rounding step is the one written here. One pass per
   element, in the operations and order of torch's fused CPU AdamW (torch.optim.AdamW(fused=True),
   ATen FusedAdamKernel.cpp, vectorized part), which is bitwise what `adamw` computes:
     p * (1 - lr wd)
     lerp: w < 0.5 -> fma(w, g - m, m), else fma(w - 1, g - m, g)
     v * b2 + c g g -> fma(c * g, g, v * b2)   (as torch's build contracts it)
     d = sqrt(v) / bc2 + eps                    (the IEEE square root, a true division)
     p + (-step * m) / d
   torch's own scalar loop for the last (numel mod vector width) elements of a tensor rounds the
   second moment differently; adam.py leaves those elements to torch. Dividing instead of
   multiplying by 1 / bc2 costs nothing measurable: the loop is bound by memory.
   Gradients and the compute copy may be fp32 or bf16 (round to nearest even, as torch); out NULL:
   no copy (an fp32 compute copy is the master itself). */
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f_to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? (uint16_t)0x7FC0 : r;
}

#define ADAMW(GET, PUT) for (int64_t i = 0; i < n; i++) { \
    float g = GET; if (use_scale) g = g * scale; float pi = p[i]; if (use_decay) pi = pi * decay; \
    float mi = small ? __builtin_fmaf(w1, g - m[i], m[i]) : __builtin_fmaf(w1_minus_1, g - m[i], g); \
    float vi = __builtin_fmaf(value2 * g, g, v[i] * beta2); \
    float d = __builtin_sqrtf(vi) / bias2_sqrt + eps; pi = pi + (neg_step * mi) / d; \
    p[i] = pi; m[i] = mi; v[i] = vi; PUT; }

void adamw(float* restrict p, const void* restrict grad, int grad_bf16, float* restrict m, float* restrict v,
           void* restrict out, int out_bf16, int64_t n, float decay, int use_decay, float scale, int use_scale,
           float w1, float beta2, float value2, float bias2_sqrt, float eps, float neg_step) {
  const int small = __builtin_fabsf(w1) < 0.5f;  /* torch's lerp: two formulas, by the weight */
  const float w1_minus_1 = w1 - 1.0f;
  if (!out) {
    if (grad_bf16) { const uint16_t* gb = grad; ADAMW(bf16_to_f(gb[i]), (void)0) }
    else { const float* gf = grad; ADAMW(gf[i], (void)0) }
  }
  else if (grad_bf16 && out_bf16) { const uint16_t* gb = grad; uint16_t* ob = out; ADAMW(bf16_to_f(gb[i]), ob[i] = f_to_bf16(pi)) }
  else if (grad_bf16) { const uint16_t* gb = grad; float* of = out; ADAMW(bf16_to_f(gb[i]), of[i] = pi) }
  else if (out_bf16) { const float* gf = grad; uint16_t* ob = out; ADAMW(gf[i], ob[i] = f_to_bf16(pi)) }
  else { const float* gf = grad; float* of = out; ADAMW(gf[i], of[i] = pi) }
}

/* The bandwidth floor: the same bytes in and out as `adamw` (bf16 grad and copy), no math. */
void touch(float* restrict p, const uint16_t* restrict g, float* restrict m, float* restrict v, uint16_t* restrict c, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float gi = bf16_to_f(g[i]);
    p[i] += gi; m[i] += gi; v[i] += gi; c[i] = g[i];
  }
}
