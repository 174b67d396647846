/* AdamW kernels on flat host buffers, built at first use by slidefusion/offload/kernels.py.

   Compiled with -ffp-contract=off so every rounding step is the one written here. The
   operations mirror torch's CPU kernels for torch.optim.AdamW (single-tensor path):
     lerp_(g, w) with w < 0.5    -> fma(w, g - m, m)           (ATen lerp_vec)
     mul_(b2).addcmul_(g, g, c)  -> fma(c * g, g, v * b2)       (ATen addcmul, contracted)
     sqrt / bc2 + eps, addcdiv   -> p + (-step * m) / d          (ATen addcdiv)
   torch's sqrt on CPU is not correctly rounded, so the bitwise-exact pair `moments` + `apply`
   leaves the square root to torch between them; `fused` does everything in one pass with the
   IEEE square root and a reciprocal multiply for the bias correction (a few ulp from torch).
   Gradients and the compute copy may be fp32 or bf16 (round to nearest even, as torch). */
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f_to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? (uint16_t)0x7FC0 : r;
}

#define MOMENTS(GET) for (int64_t i = 0; i < n; i++) { \
    float g = GET; if (use_scale) g = g * scale; if (use_decay) p[i] = p[i] * decay; \
    m[i] = __builtin_fmaf(w1, g - m[i], m[i]); v[i] = __builtin_fmaf(value2 * g, g, v[i] * beta2); }

void moments(float* restrict p, const void* restrict grad, int grad_bf16, float* restrict m, float* restrict v,
             int64_t n, float decay, int use_decay, float scale, int use_scale, float w1, float beta2, float value2) {
  if (grad_bf16) { const uint16_t* gb = grad; MOMENTS(bf16_to_f(gb[i])) }
  else { const float* gf = grad; MOMENTS(gf[i]) }
}

#define APPLY(PUT) for (int64_t i = 0; i < n; i++) { \
    float d = s[i] / bias2_sqrt + eps; float pi = p[i] + (neg_step * m[i]) / d; p[i] = pi; PUT; }

void apply(float* restrict p, const float* restrict m, const float* restrict s, void* restrict out, int out_bf16,
           int64_t n, float bias2_sqrt, float eps, float neg_step) {
  if (out_bf16) { uint16_t* ob = out; APPLY(ob[i] = f_to_bf16(pi)) }
  else { float* of = out; APPLY(of[i] = pi) }
}

#define FUSED(GET, PUT) for (int64_t i = 0; i < n; i++) { \
    float g = GET; if (use_scale) g = g * scale; float pi = p[i]; if (use_decay) pi = pi * decay; \
    float mi = __builtin_fmaf(w1, g - m[i], m[i]); float vi = __builtin_fmaf(value2 * g, g, v[i] * beta2); \
    float d = __builtin_sqrtf(vi) * inv_bias2_sqrt + eps; pi = pi + (neg_step * mi) / d; \
    p[i] = pi; m[i] = mi; v[i] = vi; PUT; }

void fused(float* restrict p, const void* restrict grad, int grad_bf16, float* restrict m, float* restrict v,
           void* restrict out, int out_bf16, int64_t n, float decay, int use_decay, float scale, int use_scale,
           float w1, float beta2, float value2, float bias2_sqrt, float eps, float neg_step) {
  const float inv_bias2_sqrt = 1.0f / bias2_sqrt;  /* one division fewer per element: the divider bounds this loop */
  if (grad_bf16 && out_bf16) { const uint16_t* gb = grad; uint16_t* ob = out; FUSED(bf16_to_f(gb[i]), ob[i] = f_to_bf16(pi)) }
  else if (grad_bf16) { const uint16_t* gb = grad; float* of = out; FUSED(bf16_to_f(gb[i]), of[i] = pi) }
  else if (out_bf16) { const float* gf = grad; uint16_t* ob = out; FUSED(gf[i], ob[i] = f_to_bf16(pi)) }
  else { const float* gf = grad; float* of = out; FUSED(gf[i], of[i] = pi) }
}

/* The bandwidth floor: the same bytes in and out as `fused` (bf16 grad and copy), no math. */
void touch(float* restrict p, const uint16_t* restrict g, float* restrict m, float* restrict v, uint16_t* restrict c, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float gi = bf16_to_f(g[i]);
    p[i] += gi; m[i] += gi; v[i] += gi; c[i] = g[i];
  }
}
