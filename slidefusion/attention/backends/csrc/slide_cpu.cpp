// Compiled CPU kernel for slide / neighbourhood attention, forward and backward.
//
// Tensors are (B, T, H, W, heads, D), contiguous, so one (token, head) row of q, k or v is D
// contiguous numbers and neighbouring tokens of one head are heads*D apart. Offsets are
// (B, T, H, W, heads, Ko, 3) with Ko = K or 1. The Python side (`cpp.py`) checks arguments.
//
// One query-head at a time (threads split the queries):
//   1. Sample points: slot s sits at its window position (NATTEN's border rule) plus its offset,
//      clamped into the grid; its key and value mix 8 corners with trilinear weights. Without
//      offsets a slot is one integer position (one "corner" of weight 1).
//   2. Scores: q . k is linear in k, so the score at a point is the weighted sum of the scores at
//      its corners. Corners of neighbouring slots coincide, so scores are taken once per token of
//      the points' bounding box (when that box is smaller than 8*K tokens, else once per corner).
//   3. Softmax over the K slots, then out = sum over box tokens of A[u] v[u], where A[u] sums the
//      probability-times-weight of every corner landing on u: one axpy per token, not per corner.
//   4. The backward replays 1-3 from the saved log-sum-exp. dq is per query; dk and dv are
//      scatter-adds onto box tokens, into one buffer per thread (summed at the end), so threads
//      never write to the same memory.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

// Without -march=native (the build is cached and may be shared between machines), the hot loops are
// compiled several times, for AVX-512, AVX2+FMA and baseline x86-64, and the loader picks the best
// the CPU has (GCC's target_clones). Everything they call is forced inline so it is compiled for
// that target too.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SLIDE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define SLIDE_INLINE inline __attribute__((always_inline))
#else
#define SLIDE_CLONES
#define SLIDE_INLINE inline
#endif

namespace {

struct Geometry {
  int64_t B, T, H, W, heads, D;
  int64_t kt, kh, kw, K, Ko;
  bool has_off;
  double scale;
  int64_t tokens() const { return T * H * W; }
  int64_t row() const { return heads * D; }  // distance between neighbouring tokens of one head
};

template <typename T>
SLIDE_INLINE T dot(const T* __restrict a, const T* __restrict b, int64_t D) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

template <typename T>
SLIDE_INLINE void axpy(T alpha, const T* __restrict x, T* __restrict y, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] += alpha * x[d];
}

inline int64_t window_start(int64_t i, int64_t k, int64_t L) {
  return std::min(std::max(i - k / 2, int64_t(0)), L - k);
}

// The sample points of one query-head, as scores-on-tokens: `tokens` (U) are the grid tokens
// whose scores are taken. Without offsets slot s is token U[s]. With offsets slot s mixes the 8
// corners base[s] + {0,1} * stride (per axis, indices into U) with trilinear weights from `frac`.
template <typename T>
struct Samples {
  std::vector<int64_t> tokens;
  std::vector<int32_t> base, lo;  // (K,) first corner in U; (K, 3) low corner in the grid
  std::vector<T> frac;         // (K, 3)
  std::vector<uint8_t> gate;   // (K, 3): the clamp left the point alone, so d point / d offset = 1
  int32_t stride[3] = {0, 0, 0};

  explicit Samples(const Geometry& g) : tokens(8 * g.K), base(g.K), lo(3 * g.K), frac(3 * g.K), gate(3 * g.K) {}
};

// Neighbourhood: the K window tokens in slot order. Shared by all heads.
template <typename T>
SLIDE_INLINE void window_samples(const Geometry& g, int64_t t, int64_t h, int64_t w, Samples<T>& S) {
  const int64_t st = window_start(t, g.kt, g.T), sh = window_start(h, g.kh, g.H), sw = window_start(w, g.kw, g.W);
  S.tokens.resize(g.K);
  int64_t s = 0;
  for (int64_t a = 0; a < g.kt; ++a)
    for (int64_t b = 0; b < g.kh; ++b)
      for (int64_t c = 0; c < g.kw; ++c) S.tokens[s++] = ((st + a) * g.H + sh + b) * g.W + sw + c;
}

// Offsets: clamped points and their low corners; see the file comment, step 2. A point on the
// last position L-1 is read as the high corner of cell (L-2, L-1) with fraction 1, so every low
// corner has its high neighbour inside the grid (an axis of length 1 has one corner, stride 0).
template <typename T>
SLIDE_INLINE void offset_samples(const Geometry& g, int64_t t, int64_t h, int64_t w, const T* off, Samples<T>& S) {
  const int64_t L[3] = {g.T, g.H, g.W};
  const int64_t start[3] = {window_start(t, g.kt, g.T), window_start(h, g.kh, g.H), window_start(w, g.kw, g.W)};
  int64_t box_lo[3] = {L[0], L[1], L[2]}, box_hi[3] = {0, 0, 0};
  for (int64_t s = 0; s < g.K; ++s) {
    const int64_t slot[3] = {s / (g.kh * g.kw), (s / g.kw) % g.kh, s % g.kw};
    const T* o = off + (g.Ko == 1 ? 0 : 3 * s);
    for (int a = 0; a < 3; ++a) {
      const T pos = T(start[a] + slot[a]) + o[a];
      const T top = T(L[a] - 1);
      // The reference clamps with clamp(min=0) then minimum(., L-1): the gradient passes on
      // [0, L-1); at L-1 it is zero (the minimum's tie, whose corners are one token).
      S.gate[3 * s + a] = pos >= T(0) && pos < top;
      const T p = std::min(std::max(pos, T(0)), top);
      const int64_t lo = std::min(static_cast<int64_t>(p), std::max<int64_t>(L[a] - 2, 0));  // p >= 0: truncation is floor
      S.lo[3 * s + a] = static_cast<int32_t>(lo);
      S.frac[3 * s + a] = p - T(lo);
      box_lo[a] = std::min(box_lo[a], lo);
      box_hi[a] = std::max(box_hi[a], std::min(lo + 1, L[a] - 1));
    }
  }
  const int64_t ext[3] = {box_hi[0] - box_lo[0] + 1, box_hi[1] - box_lo[1] + 1, box_hi[2] - box_lo[2] + 1};
  const bool use_box = ext[0] * ext[1] * ext[2] <= 8 * g.K;  // else far-flung points: 8 tokens per slot
  S.tokens.resize(use_box ? ext[0] * ext[1] * ext[2] : 8 * g.K);
  for (int64_t s = 0; s < g.K; ++s) {
    const int32_t* x = &S.lo[3 * s];
    if (use_box) {
      S.base[s] = static_cast<int32_t>(((x[0] - box_lo[0]) * ext[1] + x[1] - box_lo[1]) * ext[2] + x[2] - box_lo[2]);
      continue;
    }
    S.base[s] = static_cast<int32_t>(8 * s);
    for (int c = 0; c < 8; ++c) {
      const int64_t xt = x[0] + (L[0] > 1 ? (c >> 2) & 1 : 0);
      const int64_t xh = x[1] + (L[1] > 1 ? (c >> 1) & 1 : 0);
      const int64_t xw = x[2] + (L[2] > 1 ? c & 1 : 0);
      S.tokens[8 * s + c] = (xt * g.H + xh) * g.W + xw;
    }
  }
  if (use_box) {
    int64_t u = 0;
    for (int64_t a = 0; a < ext[0]; ++a)
      for (int64_t b = 0; b < ext[1]; ++b)
        for (int64_t c = 0; c < ext[2]; ++c) S.tokens[u++] = ((box_lo[0] + a) * g.H + box_lo[1] + b) * g.W + box_lo[2] + c;
    S.stride[0] = L[0] > 1 ? static_cast<int32_t>(ext[1] * ext[2]) : 0;
    S.stride[1] = L[1] > 1 ? static_cast<int32_t>(ext[2]) : 0;
    S.stride[2] = L[2] > 1 ? 1 : 0;
  } else {
    S.stride[0] = 4, S.stride[1] = 2, S.stride[2] = 1;
  }
}

// Per-thread work arrays, sized for the largest token list (8*K).
template <typename T>
struct Work {
  std::vector<T> score, dscore, prob, dlogit, A, dP;  // per token of U: score, dscore, A, dP; per slot: prob, dlogit
  explicit Work(const Geometry& g)
      : score(8 * g.K), dscore(8 * g.K), prob(g.K), dlogit(g.K), A(8 * g.K), dP(8 * g.K) {}
};

// The 8 corners of slot s: index c = 4*bit_t + 2*bit_h + bit_w into `idx`, weights `wgt`.
template <typename T>
struct Corners {
  int32_t idx[8];
  T wt[2], wh[2], ww[2];
  SLIDE_INLINE Corners(const Samples<T>& S, int64_t s) {
    const int32_t b = S.base[s];
    for (int c = 0; c < 8; ++c) idx[c] = b + ((c >> 2) & 1) * S.stride[0] + ((c >> 1) & 1) * S.stride[1] + (c & 1) * S.stride[2];
    const T* f = &S.frac[3 * s];
    wt[0] = T(1) - f[0], wt[1] = f[0], wh[0] = T(1) - f[1], wh[1] = f[1], ww[0] = T(1) - f[2], ww[1] = f[2];
  }
  SLIDE_INLINE T weight(int c) const { return wt[(c >> 2) & 1] * wh[(c >> 1) & 1] * ww[c & 1]; }
  SLIDE_INLINE T read(const T* x) const {  // trilinear interpolation of per-token x at the point
    T r = 0;
    for (int c = 0; c < 8; ++c) r += weight(c) * x[idx[c]];
    return r;
  }
  SLIDE_INLINE void spread(T value, T* x) const {  // adjoint of read
    for (int c = 0; c < 8; ++c) x[idx[c]] += value * weight(c);
  }
  // d read(x) / d frac per axis.
  SLIDE_INLINE void grad(const T* x, T* out) const {
    T X[8];
    for (int c = 0; c < 8; ++c) X[c] = x[idx[c]];
    out[0] = out[1] = out[2] = 0;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        out[0] += wh[i] * ww[j] * (X[4 + 2 * i + j] - X[2 * i + j]);
        out[1] += wt[i] * ww[j] * (X[4 * i + 2 + j] - X[4 * i + j]);
        out[2] += wt[i] * wh[j] * (X[4 * i + 2 * j + 1] - X[4 * i + 2 * j]);
      }
  }
};

// Slot logits z_s into z (K): the score at the point (OFF) or at the window token.
template <bool OFF, typename T>
SLIDE_INLINE void slot_logits(const Geometry& g, const Samples<T>& S, const T* score, T* z) {
  for (int64_t s = 0; s < g.K; ++s) z[s] = OFF ? Corners<T>(S, s).read(score) : score[s];
}

// Adjoint of slot_logits: dst[u] = sum over corners landing on u of per_slot[s] * weight.
template <bool OFF, typename T>
SLIDE_INLINE void spread(const Geometry& g, const Samples<T>& S, const T* per_slot, T* dst) {
  if (!OFF) {
    std::copy(per_slot, per_slot + g.K, dst);
    return;
  }
  std::fill(dst, dst + S.tokens.size(), T(0));
  for (int64_t s = 0; s < g.K; ++s) Corners<T>(S, s).spread(per_slot[s], dst);
}

// One query-head: out (D) and its log-sum-exp. kb, vb: this sample's and head's token 0.
template <bool OFF, typename T>
SLIDE_INLINE void forward_one(const Geometry& g, const Samples<T>& S, Work<T>& Wk, const T* q, const T* kb, const T* vb,
                 T* out, T* lse) {
  const int64_t V = S.tokens.size(), D = g.D, R = g.row();
  const T scale = T(g.scale);
  for (int64_t u = 0; u < V; ++u) Wk.score[u] = scale * dot(q, kb + S.tokens[u] * R, D);
  T* z = Wk.prob.data();
  slot_logits<OFF>(g, S, Wk.score.data(), z);
  const T m = *std::max_element(z, z + g.K);
  T l = 0;
  for (int64_t s = 0; s < g.K; ++s) l += (z[s] = std::exp(z[s] - m));
  const T inv = T(1) / l;
  for (int64_t s = 0; s < g.K; ++s) z[s] *= inv;
  spread<OFF>(g, S, z, Wk.A.data());
  std::fill(out, out + D, T(0));
  for (int64_t u = 0; u < V; ++u)
    if (Wk.A[u] != T(0)) axpy(Wk.A[u], vb + S.tokens[u] * R, out, D);
  *lse = m + std::log(l);
}

// One query-head's gradients: dq (D) written; dkb, dvb (this thread's buffers at this sample and
// head) and doff (Ko, 3) accumulated.
template <bool OFF, typename T>
SLIDE_INLINE void backward_one(const Geometry& g, const Samples<T>& S, Work<T>& Wk, const T* q, const T* kb, const T* vb,
                  const T* dout, const T* out, T lse, T* dq, T* dkb, T* dvb, T* doff) {
  const int64_t V = S.tokens.size(), D = g.D, R = g.row();
  const T scale = T(g.scale);
  for (int64_t u = 0; u < V; ++u) {
    Wk.score[u] = scale * dot(q, kb + S.tokens[u] * R, D);
    Wk.dP[u] = dot(dout, vb + S.tokens[u] * R, D);  // d loss / d (weight of value u)
  }
  const T delta = dot(dout, out, D);  // sum_s p_s dp_s
  T* p = Wk.prob.data();
  slot_logits<OFF>(g, S, Wk.score.data(), p);
  for (int64_t s = 0; s < g.K; ++s) p[s] = std::exp(p[s] - lse);
  spread<OFF>(g, S, p, Wk.A.data());
  T* ds = Wk.dlogit.data();
  slot_logits<OFF>(g, S, Wk.dP.data(), ds);
  for (int64_t s = 0; s < g.K; ++s) ds[s] = p[s] * (ds[s] - delta);
  if (OFF) {
    // d point: through the logit (corner scores) and through the value (corner dO . v).
    for (int64_t s = 0; s < g.K; ++s) {
      const Corners<T> C(S, s);
      T gs[3], gv[3];
      C.grad(Wk.score.data(), gs);
      C.grad(Wk.dP.data(), gv);
      T* d = doff + (g.Ko == 1 ? 0 : 3 * s);
      for (int a = 0; a < 3; ++a)
        if (S.gate[3 * s + a]) d[a] += ds[s] * gs[a] + p[s] * gv[a];
    }
  }
  spread<OFF>(g, S, ds, Wk.dscore.data());
  std::fill(dq, dq + D, T(0));
  for (int64_t u = 0; u < V; ++u) {
    const int64_t at = S.tokens[u] * R;
    if (Wk.A[u] != T(0)) axpy(Wk.A[u], dout, dvb + at, D);
    const T d = scale * Wk.dscore[u];
    if (d != T(0)) {
      axpy(d, kb + at, dq, D);
      axpy(d, q, dkb + at, D);
    }
  }
}

// Calls fn(Samples, b, row r = b*N + n, head) for every query-head in rows [begin, end).
template <typename T, typename Fn>
SLIDE_INLINE void for_each_query(const Geometry& g, const T* off, int64_t begin, int64_t end, Samples<T>& S, Fn fn) {
  const int64_t N = g.tokens();
  for (int64_t r = begin; r < end; ++r) {
    const int64_t b = r / N, n = r % N;
    const int64_t t = n / (g.H * g.W), h = (n / g.W) % g.H, w = n % g.W;
    if (!g.has_off) window_samples(g, t, h, w, S);
    for (int64_t head = 0; head < g.heads; ++head) {
      if (g.has_off) offset_samples(g, t, h, w, off + (r * g.heads + head) * g.Ko * 3, S);
      fn(b, r, head);
    }
  }
}

Geometry geometry(const torch::Tensor& q, const torch::Tensor& off, int64_t kt, int64_t kh, int64_t kw, double scale) {
  Geometry g{q.size(0), q.size(1), q.size(2), q.size(3), q.size(4), q.size(5), kt, kh, kw, kt * kh * kw, 1,
             off.numel() > 0, scale};
  if (g.has_off) g.Ko = off.size(5);
  return g;
}

int64_t grain(const Geometry& g) { return std::max<int64_t>(1, 256 / g.heads); }

// The kernel's tensors (contiguous). Outputs: out, lse (forward); dq, dk, dv, doff (backward).
template <typename T>
struct Ptrs {
  const T *q, *k, *v, *off, *out, *lse, *dout;
  T *out_w, *lse_w, *dq, *dk, *dv, *doff;
};

template <typename T>
SLIDE_INLINE void forward_rows(const Geometry& g, const Ptrs<T>& x, int64_t begin, int64_t end) {
  const int64_t N = g.tokens(), R = g.row();
  Samples<T> S(g);
  Work<T> Wk(g);
  for_each_query(g, x.off, begin, end, S, [&](int64_t b, int64_t r, int64_t head) {
    const int64_t qh = r * g.heads + head, base = b * N * R + head * g.D;
    if (g.has_off)
      forward_one<true>(g, S, Wk, x.q + qh * g.D, x.k + base, x.v + base, x.out_w + qh * g.D, x.lse_w + qh);
    else
      forward_one<false>(g, S, Wk, x.q + qh * g.D, x.k + base, x.v + base, x.out_w + qh * g.D, x.lse_w + qh);
  });
}

// dk, dv: this thread's gradient buffers.
template <typename T>
SLIDE_INLINE void backward_rows(const Geometry& g, const Ptrs<T>& x, T* dk, T* dv, int64_t begin, int64_t end) {
  const int64_t N = g.tokens(), R = g.row();
  Samples<T> S(g);
  Work<T> Wk(g);
  for_each_query(g, x.off, begin, end, S, [&](int64_t b, int64_t r, int64_t head) {
    const int64_t qh = r * g.heads + head, base = b * N * R + head * g.D, at = qh * g.D;
    if (g.has_off)
      backward_one<true>(g, S, Wk, x.q + at, x.k + base, x.v + base, x.dout + at, x.out + at, x.lse[qh],
                         x.dq + at, dk + base, dv + base, x.doff + qh * g.Ko * 3);
    else
      backward_one<false>(g, S, Wk, x.q + at, x.k + base, x.v + base, x.dout + at, x.out + at, x.lse[qh],
                          x.dq + at, dk + base, dv + base, static_cast<T*>(nullptr));
  });
}

// Entry points compiled once per instruction set (see SLIDE_CLONES); the loader picks the best.
SLIDE_CLONES void forward_rows_f32(const Geometry& g, const Ptrs<float>& x, int64_t b, int64_t e) { forward_rows(g, x, b, e); }
SLIDE_CLONES void forward_rows_f64(const Geometry& g, const Ptrs<double>& x, int64_t b, int64_t e) { forward_rows(g, x, b, e); }
SLIDE_CLONES void backward_rows_f32(const Geometry& g, const Ptrs<float>& x, float* dk, float* dv, int64_t b, int64_t e) {
  backward_rows(g, x, dk, dv, b, e);
}
SLIDE_CLONES void backward_rows_f64(const Geometry& g, const Ptrs<double>& x, double* dk, double* dv, int64_t b, int64_t e) {
  backward_rows(g, x, dk, dv, b, e);
}

template <typename T>
void run_forward(const Geometry& g, const Ptrs<T>& x) {
  at::parallel_for(0, g.B * g.tokens(), grain(g), [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, float>) forward_rows_f32(g, x, begin, end);
    else forward_rows_f64(g, x, begin, end);
  });
}

template <typename T>
void run_backward(const Geometry& g, const Ptrs<T>& x, T* dk_all, T* dv_all, int64_t buffers) {
  const int64_t numel = g.B * g.tokens() * g.row();
  at::parallel_for(0, g.B * g.tokens(), grain(g), [&](int64_t begin, int64_t end) {
    const int64_t tid = at::get_thread_num();
    TORCH_CHECK(tid < buffers, "slide_cpu: more threads than gradient buffers");
    if constexpr (std::is_same_v<T, float>) backward_rows_f32(g, x, dk_all + tid * numel, dv_all + tid * numel, begin, end);
    else backward_rows_f64(g, x, dk_all + tid * numel, dv_all + tid * numel, begin, end);
  });
}

}  // namespace

// Returns (out, lse); `offsets` is an empty tensor for neighbourhood attention.
std::vector<torch::Tensor> slide_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor offsets,
                                         int64_t kt, int64_t kh, int64_t kw, double scale) {
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous(), offsets = offsets.contiguous();
  const Geometry g = geometry(q, offsets, kt, kh, kw, scale);
  auto out = torch::empty_like(q);
  auto lse = torch::empty(q.sizes().slice(0, 5), q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "slide_forward", [&] {
    Ptrs<scalar_t> x{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                     g.has_off ? offsets.data_ptr<scalar_t>() : nullptr, nullptr, nullptr, nullptr,
                     out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), nullptr, nullptr, nullptr, nullptr};
    run_forward<scalar_t>(g, x);
  });
  return {out, lse};
}

// Returns (dq, dk, dv, doffsets); doffsets is empty without offsets.
std::vector<torch::Tensor> slide_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor offsets,
                                          torch::Tensor out, torch::Tensor lse, torch::Tensor dout, int64_t kt,
                                          int64_t kh, int64_t kw, double scale) {
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous(), offsets = offsets.contiguous();
  out = out.contiguous(), lse = lse.contiguous(), dout = dout.contiguous();
  const Geometry g = geometry(q, offsets, kt, kh, kw, scale);
  const int64_t buffers = std::max(1, at::get_num_threads());
  auto dq = torch::empty_like(q);
  auto dk_all = torch::zeros({buffers, q.numel()}, q.options());
  auto dv_all = torch::zeros({buffers, q.numel()}, q.options());
  auto doff = torch::zeros_like(offsets);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "slide_backward", [&] {
    Ptrs<scalar_t> x{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                     g.has_off ? offsets.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(),
                     lse.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), nullptr, nullptr, dq.data_ptr<scalar_t>(),
                     nullptr, nullptr, g.has_off ? doff.data_ptr<scalar_t>() : nullptr};
    run_backward<scalar_t>(g, x, dk_all.data_ptr<scalar_t>(), dv_all.data_ptr<scalar_t>(), buffers);
  });
  auto reduce = [&](const torch::Tensor& all) { return (buffers == 1 ? all[0] : all.sum(0)).view(q.sizes()); };
  return {dq, reduce(dk_all), reduce(dv_all), doff};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &slide_forward, "slide attention forward (out, lse)");
  m.def("backward", &slide_backward, "slide attention backward (dq, dk, dv, doffsets)");
}
