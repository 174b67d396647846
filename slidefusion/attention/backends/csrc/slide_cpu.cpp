// Compiled CPU kernel for slide / neighbourhood attention, forward and backward.
//
// Tensors are (B, T, H, W, heads, D), contiguous, so one (token, head) row of q, k or v is D
// contiguous numbers and neighbouring tokens of one head are heads*D apart. Offsets are
// (B, T, H, W, heads, Ko, 3) with Ko = K or 1; lse and delta are (B, T, H, W, heads). The Python
// side (`cpp.py`, `ops.py`) checks and normalises the arguments.
//
// One query-head at a time. Work goes plane by plane ((sample, head) pairs), queries in grid order
// inside a plane, so neighbouring queries, whose windows overlap, run back to back and the keys
// and values they read (one head's slice of a few frames) stay in L2.
//   1. Sample points: slot s sits at its window position (NATTEN's border rule) plus its offset,
//      clamped into the grid; its key and value mix 8 corners with trilinear weights. Without
//      offsets a slot is one integer position (one "corner" of weight 1).
//   2. Scores: q . k is linear in k, so the score at a point is the weighted sum of the scores at
//      its corners. Corners of neighbouring slots coincide, so scores are taken once per token of
//      the points' bounding box (when that box is smaller than 8*K tokens, else once per corner).
//   3. Softmax over the K slots, then out = sum over box tokens of A[u] v[u], where A[u] sums the
//      probability-times-weight of every corner landing on u: one axpy per token, not per corner.
//   4. The backward replays 1-3 from the saved log-sum-exp, with delta = rowsum(dout * out) - dlse
//      (so the log-sum-exp output gets its gradient by the same formula). dq is per query; dk and
//      dv are scatter-adds onto box tokens. When the planes split evenly over the threads, each
//      thread owns whole planes and adds straight into dk and dv; otherwise every thread has its
//      own buffers (summed at the end), so threads never write to the same memory.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

// The library is compiled for the CPU that builds it (-march=native; the build's cache name includes
// the CPU, see slidefusion/core/native.py). The hot loops are also compiled for AVX-512, AVX2+FMA and
// baseline x86-64, and the loader picks the best the CPU has (GCC's target_clones). Everything they
// call is forced inline (no lambdas, which GCC would compile once, for the default) so it is compiled
// for that target too.
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
  int64_t planes() const { return B * heads; }
};

#include "slide_rows.h"

inline int64_t window_start(int64_t i, int64_t k, int64_t L) {
  return std::min(std::max(i - k / 2, int64_t(0)), L - k);
}

// Window position of each slot per axis, (K,) each: built once per call.
struct Slots {
  std::vector<int32_t> axis[3];
  explicit Slots(const Geometry& g) {
    for (auto& a : axis) a.reserve(g.K);
    for (int64_t a = 0; a < g.kt; ++a)
      for (int64_t b = 0; b < g.kh; ++b)
        for (int64_t c = 0; c < g.kw; ++c) {
          axis[0].push_back(static_cast<int32_t>(a));
          axis[1].push_back(static_cast<int32_t>(b));
          axis[2].push_back(static_cast<int32_t>(c));
        }
  }
};

// The sample points of one query-head. Per-token arrays are indexed by "cell": without offsets
// cell s is window slot s; with offsets, cell c is a token of the points' bounding box (or, for
// far-flung points, corner c % 8 of slot c / 8). Slot s mixes the 8 cells base[s] + corner[c]
// with trilinear weights from `frac`. Only the U cells some corner lands on are computed: the
// touched list (cells, rows). At offsets of +-1.5 tokens about half of a 3x7x7 window's box is
// never touched, so this halves the per-token work there. Per-axis arrays are (K,) each, so the
// loops over slots vectorise.
template <typename T>
struct Samples {
  std::vector<int64_t> box_rows;  // (cells,) element offset (token * heads * D) of each cell
  std::vector<int64_t> rows;      // (U,) of the touched cells
  std::vector<int32_t> cells;     // (U,)
  std::vector<uint8_t> touched;   // (cells,)
  std::vector<int32_t> base;      // (K,)
  std::vector<int32_t> lo[3];     // (K,) low corner in the grid
  std::vector<T> frac[3];         // (K,)
  std::vector<uint8_t> gate[3];   // (K,) the clamp left the point alone: d point / d offset = 1
  std::vector<T> weight[8];       // (K,) trilinear weight of each corner
  int32_t corner[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t n_cells = 0, size = 0;  // cells, U
  int32_t non_finite = 0;         // some offset was nan

  explicit Samples(const Geometry& g)
      : box_rows(8 * g.K), rows(8 * g.K), cells(8 * g.K), touched(8 * g.K), base(g.K) {
    for (int a = 0; a < 3; ++a) lo[a].resize(g.K), frac[a].resize(g.K), gate[a].resize(g.K);
    for (auto& w : weight) w.resize(g.K);
  }
};

// Neighbourhood: the K window tokens in slot order, all touched.
template <typename T>
SLIDE_INLINE void window_samples(const Geometry& g, int64_t t, int64_t h, int64_t w, Samples<T>& S) {
  const int64_t st = window_start(t, g.kt, g.T), sh = window_start(h, g.kh, g.H), sw = window_start(w, g.kw, g.W);
  const int64_t R = g.row();
  int32_t s = 0;
  for (int64_t a = 0; a < g.kt; ++a)
    for (int64_t b = 0; b < g.kh; ++b) {
      const int64_t first = ((st + a) * g.H + sh + b) * g.W + sw;
      for (int64_t c = 0; c < g.kw; ++c, ++s) S.rows[s] = (first + c) * R, S.cells[s] = s;
    }
  S.n_cells = S.size = g.K;
}

// One axis of `offset_samples`: clamped points, low corners, fractions, gates; returns the
// box's [low, high] corner along the axis. A point on the last position L-1 is read as the high
// corner of cell (L-2, L-1) with fraction 1, so every low corner has its high neighbour inside the
// grid (an axis of length 1 has one corner).
// SHARED: one offset for every slot (Ko = 1), else per slot (stride 3); a compile-time stride
// keeps the loop a plain vector loop (a runtime one made it a gather).
template <bool SHARED, typename T>
SLIDE_INLINE void offset_axis(const Geometry& g, const Slots& slots, int a, int64_t start, int64_t L, const T* off,
                              Samples<T>& S, int64_t& box_lo, int64_t& box_hi) {
  constexpr int64_t step = SHARED ? 0 : 3;
  const T top = T(L - 1), first = T(start) + (SHARED ? off[a] : T(0));
  const int32_t last_lo = static_cast<int32_t>(std::max<int64_t>(L - 2, 0));
  const int32_t* slot = slots.axis[a].data();
  int32_t* lo = S.lo[a].data();
  T* frac = S.frac[a].data();
  uint8_t* gate = S.gate[a].data();
  int32_t mn = INT_MAX, mx = 0, bad = 0;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(| : bad)
  for (int64_t s = 0; s < g.K; ++s) {
    const T raw = first + T(slot[s]) + (SHARED ? T(0) : off[step * s + a]);
    const bool nan = raw != raw;  // an infinite point is clamped to the grid's edge below, as in the reference
    bad |= nan;
    const T pos = nan ? T(0) : raw;  // keeps the indices in the grid; the row's output is then NaN
    // The reference clamps with clamp(min=0) then minimum(., L-1): the gradient passes on
    // [0, L-1); at L-1 it is zero (the minimum's tie, whose corners are one token).
    gate[s] = (pos >= T(0)) & (pos < top);
    // Selects, not std::min / std::max (whose reference returns are branches to the vectoriser).
    const T above = pos > T(0) ? pos : T(0);
    const T p = above < top ? above : top;
    const int32_t floor = static_cast<int32_t>(p);  // p >= 0: truncation is floor
    const int32_t l = floor < last_lo ? floor : last_lo;
    lo[s] = l;
    frac[s] = p - T(l);
    mn = l < mn ? l : mn;
    mx = l > mx ? l : mx;
  }
  box_lo = mn;
  box_hi = mx + (L > 1 ? 1 : 0);
  S.non_finite |= bad;
}

// Corner weights of every slot, and the touched list (cells in ascending order).
template <typename T>
SLIDE_INLINE void corner_weights_and_touched(const Geometry& g, Samples<T>& S) {
  const T *ft = S.frac[0].data(), *fh = S.frac[1].data(), *fw = S.frac[2].data();
  for (int c = 0; c < 8; ++c) {
    T* w = S.weight[c].data();
    const bool bt = (c >> 2) & 1, bh = (c >> 1) & 1, bw = c & 1;
#pragma omp simd
    for (int64_t s = 0; s < g.K; ++s)
      w[s] = (bt ? ft[s] : T(1) - ft[s]) * (bh ? fh[s] : T(1) - fh[s]) * (bw ? fw[s] : T(1) - fw[s]);
  }
  uint8_t* touched = S.touched.data();
  std::fill(touched, touched + S.n_cells, uint8_t(0));
  for (int64_t s = 0; s < g.K; ++s)
    for (int c = 0; c < 8; ++c) touched[S.base[s] + S.corner[c]] = 1;
  int64_t u = 0;
  for (int64_t c = 0; c < S.n_cells; ++c) {  // branch-free compaction
    S.cells[u] = static_cast<int32_t>(c);
    S.rows[u] = S.box_rows[c];
    u += touched[c];
  }
  S.size = u;
}

// Offsets: see the file comment, step 2.
template <typename T>
SLIDE_INLINE void offset_samples(const Geometry& g, const Slots& slots, int64_t t, int64_t h, int64_t w, const T* off,
                                 Samples<T>& S) {
  const int64_t L[3] = {g.T, g.H, g.W};
  const int64_t start[3] = {window_start(t, g.kt, g.T), window_start(h, g.kh, g.H), window_start(w, g.kw, g.W)};
  int64_t box_lo[3], box_hi[3];
  for (int a = 0; a < 3; ++a) {
    if (g.Ko == 1) offset_axis<true>(g, slots, a, start[a], L[a], off, S, box_lo[a], box_hi[a]);
    else offset_axis<false>(g, slots, a, start[a], L[a], off, S, box_lo[a], box_hi[a]);
  }
  const int64_t e0 = box_hi[0] - box_lo[0] + 1, e1 = box_hi[1] - box_lo[1] + 1, e2 = box_hi[2] - box_lo[2] + 1;
  const int64_t R = g.row();
  const int32_t *l0 = S.lo[0].data(), *l1 = S.lo[1].data(), *l2 = S.lo[2].data();
  const int32_t step[3] = {L[0] > 1, L[1] > 1, L[2] > 1};  // an axis of length 1 has one corner
  if (e0 * e1 * e2 <= 8 * g.K) {
    const int32_t b0 = static_cast<int32_t>(box_lo[0]), b1 = static_cast<int32_t>(box_lo[1]);
    const int32_t b2 = static_cast<int32_t>(box_lo[2]), f1 = static_cast<int32_t>(e1), f2 = static_cast<int32_t>(e2);
#pragma omp simd
    for (int64_t s = 0; s < g.K; ++s) S.base[s] = ((l0[s] - b0) * f1 + l1[s] - b1) * f2 + l2[s] - b2;
    int64_t u = 0;
    for (int64_t a = 0; a < e0; ++a)
      for (int64_t b = 0; b < e1; ++b) {
        const int64_t first = ((box_lo[0] + a) * g.H + box_lo[1] + b) * g.W + box_lo[2];
        for (int64_t c = 0; c < e2; ++c) S.box_rows[u++] = (first + c) * R;
      }
    S.n_cells = u;
    for (int c = 0; c < 8; ++c)
      S.corner[c] = static_cast<int32_t>(((c >> 2) & 1) * step[0] * e1 * e2 + ((c >> 1) & 1) * step[1] * e2 + (c & 1) * step[2]);
  } else {  // far-flung points: 8 cells per slot
    for (int64_t s = 0; s < g.K; ++s) {
      S.base[s] = static_cast<int32_t>(8 * s);
      for (int c = 0; c < 8; ++c) {
        const int64_t xt = l0[s] + ((c >> 2) & 1) * step[0], xh = l1[s] + ((c >> 1) & 1) * step[1];
        const int64_t xw = l2[s] + (c & 1) * step[2];
        S.box_rows[8 * s + c] = ((xt * g.H + xh) * g.W + xw) * R;
      }
    }
    S.n_cells = 8 * g.K;
    for (int c = 0; c < 8; ++c) S.corner[c] = c;
  }
  corner_weights_and_touched(g, S);
}

// Per-thread work arrays, per cell (8*K at most) or per slot.
template <typename T>
struct Work {
  std::vector<T> score, A, dP, pair;  // per cell; pair: (A, d loss / d score) interleaved
  std::vector<T> prob, dlogit, grad[3];  // per slot; grad: d loss / d point per axis
  explicit Work(const Geometry& g) : score(8 * g.K), A(8 * g.K), dP(8 * g.K), pair(16 * g.K), prob(g.K), dlogit(g.K) {
    for (auto& x : grad) x.resize(g.K);
  }
};

// Slot values z (K) read from per-cell x: the interpolation at the point (OFF) or the cell.
template <bool OFF, typename T>
SLIDE_INLINE void slot_read(const Geometry& g, const Samples<T>& S, const T* __restrict x, T* __restrict z) {
  if (!OFF) {
    std::copy(x, x + g.K, z);
    return;
  }
  const int32_t* base = S.base.data();
  const T *ft = S.frac[0].data(), *fh = S.frac[1].data(), *fw = S.frac[2].data();
  const int32_t c1 = S.corner[1], c2 = S.corner[2], c3 = S.corner[3], c4 = S.corner[4];
  const int32_t c5 = S.corner[5], c6 = S.corner[6], c7 = S.corner[7];
#pragma omp simd
  for (int64_t s = 0; s < g.K; ++s) {
    const T* p = x + base[s];
    const T a = T(1) - fw[s], b = fw[s];
    const T h0 = a * p[0] + b * p[c1], h1 = a * p[c2] + b * p[c3];  // t low: h low / high
    const T h2 = a * p[c4] + b * p[c5], h3 = a * p[c6] + b * p[c7];  // t high
    const T lo = (T(1) - fh[s]) * h0 + fh[s] * h1, hi = (T(1) - fh[s]) * h2 + fh[s] * h3;
    z[s] = (T(1) - ft[s]) * lo + ft[s] * hi;
  }
}

// Adjoint of slot_read: dst[cell] = sum over corners landing on the cell of src[s] * weight.
// Without offsets a copy.
template <bool OFF, typename T>
SLIDE_INLINE void spread(const Geometry& g, const Samples<T>& S, const T* __restrict src, T* __restrict dst) {
  if (!OFF) {
    std::copy(src, src + g.K, dst);
    return;
  }
  std::fill(dst, dst + S.n_cells, T(0));
  for (int64_t s = 0; s < g.K; ++s) {
    const int32_t b = S.base[s];
    for (int c = 0; c < 8; ++c) dst[b + S.corner[c]] += src[s] * S.weight[c][s];
  }
}

// spread of two per-slot arrays (a, b) into one interleaved per-cell array: pair[2*cell + {0, 1}].
// One read-modify-write of two adjacent numbers per corner instead of two scattered ones.
template <bool OFF, typename T>
SLIDE_INLINE void spread_pair(const Geometry& g, const Samples<T>& S, const T* __restrict a, const T* __restrict b,
                              T* __restrict pair) {
  typedef T two __attribute__((vector_size(2 * sizeof(T)), may_alias));
  two* cells = reinterpret_cast<two*>(pair);
  if (!OFF) {
    for (int64_t s = 0; s < g.K; ++s) cells[s] = two{a[s], b[s]};
    return;
  }
  std::fill(pair, pair + 2 * S.n_cells, T(0));
  for (int64_t s = 0; s < g.K; ++s) {
    const int32_t at = S.base[s];
    const two ab = {a[s], b[s]};
    for (int c = 0; c < 8; ++c) cells[at + S.corner[c]] += ab * S.weight[c][s];
  }
}

// One query-head: out (D) and its log-sum-exp. kb, vb: this plane's token 0.
template <bool OFF, int DC, typename T>
SLIDE_INLINE void forward_one(const Geometry& g, const Samples<T>& S, Work<T>& Wk, const T* q, const T* kb,
                              const T* vb, T* out, T* lse) {
  T* score = Wk.score.data();
  row_scores<DC>(q, kb, S.rows.data(), S.cells.data(), S.size, T(g.scale), score, dim<DC>(g));
  T* z = Wk.prob.data();
  slot_read<OFF>(g, S, score, z);
  *lse = softmax(z, g.K);
  spread<OFF>(g, S, z, Wk.A.data());
  weighted_rows<DC>(Wk.A.data(), vb, S.rows.data(), S.cells.data(), S.size, out, dim<DC>(g));
}

// Per slot of one query-head, in one pass over its 8 corners: the probability p (from the saved
// lse), d loss / d (q . k at the point) into ds, and (with offsets) d loss / d offset, written to
// doff (Ko, 3) (SUM: Ko = 1, the sum over slots). The offset gradient flows through the logit
// (the corner scores) and through the value (the corner dout . v), and is zero where the clamp
// holds a point.
template <bool SUM, typename T>
SLIDE_INLINE void slot_terms(const Geometry& g, const Samples<T>& S, Work<T>& Wk, T lse, T delta, T* __restrict doff) {
  const T *__restrict score = Wk.score.data(), *__restrict dP = Wk.dP.data();
  T *__restrict p_out = Wk.prob.data(), *__restrict ds_out = Wk.dlogit.data();
  T *__restrict grad_t = Wk.grad[0].data(), *__restrict grad_h = Wk.grad[1].data(), *__restrict grad_w = Wk.grad[2].data();
  const int32_t* base = S.base.data();
  const T *ft = S.frac[0].data(), *fh = S.frac[1].data(), *fw = S.frac[2].data();
  const uint8_t *gt = S.gate[0].data(), *gh = S.gate[1].data(), *gw = S.gate[2].data();
  const int32_t c1 = S.corner[1], c2 = S.corner[2], c3 = S.corner[3], c4 = S.corner[4];
  const int32_t c5 = S.corner[5], c6 = S.corner[6], c7 = S.corner[7];
  const T scale = T(g.scale);
  T sum_t = 0, sum_h = 0, sum_w = 0;
#pragma omp simd reduction(+ : sum_t, sum_h, sum_w)
  for (int64_t s = 0; s < g.K; ++s) {
    const T *x = score + base[s], *y = dP + base[s];
    const T at = T(1) - ft[s], bt = ft[s], ah = T(1) - fh[s], bh = fh[s], aw = T(1) - fw[s], bw = fw[s];
    // Corner c = 4*bit_t + 2*bit_h + bit_w. Lerp along w, then h, then t; the gradient along an
    // axis lerps the other two and differences along it.
    const T x01 = aw * x[0] + bw * x[c1], x23 = aw * x[c2] + bw * x[c3];
    const T x45 = aw * x[c4] + bw * x[c5], x67 = aw * x[c6] + bw * x[c7];
    const T y01 = aw * y[0] + bw * y[c1], y23 = aw * y[c2] + bw * y[c3];
    const T y45 = aw * y[c4] + bw * y[c5], y67 = aw * y[c6] + bw * y[c7];
    const T xl = ah * x01 + bh * x23, xh = ah * x45 + bh * x67, yl = ah * y01 + bh * y23, yh = ah * y45 + bh * y67;
    const T p = softmax_exp(at * xl + bt * xh - lse);
    const T dz = p * (at * yl + bt * yh - delta);  // d loss / d logit
    p_out[s] = p;
    ds_out[s] = dz * scale;
    const T d_t = dz * (xh - xl) + p * (yh - yl);
    const T d_h = dz * (at * (x23 - x01) + bt * (x67 - x45)) + p * (at * (y23 - y01) + bt * (y67 - y45));
    const T xw = at * (ah * (x[c1] - x[0]) + bh * (x[c3] - x[c2])) + bt * (ah * (x[c5] - x[c4]) + bh * (x[c7] - x[c6]));
    const T yw = at * (ah * (y[c1] - y[0]) + bh * (y[c3] - y[c2])) + bt * (ah * (y[c5] - y[c4]) + bh * (y[c7] - y[c6]));
    const T d_w = dz * xw + p * yw;
    const T e_t = T(gt[s]) * d_t, e_h = T(gh[s]) * d_h, e_w = T(gw[s]) * d_w;  // products, not branches
    if (SUM) {
      sum_t += e_t, sum_h += e_h, sum_w += e_w;
    } else {
      grad_t[s] = e_t, grad_h[s] = e_h, grad_w[s] = e_w;
    }
  }
  if (SUM) {
    doff[0] = sum_t, doff[1] = sum_h, doff[2] = sum_w;
    return;
  }
  for (int64_t s = 0; s < g.K; ++s) doff[3 * s] = grad_t[s], doff[3 * s + 1] = grad_h[s], doff[3 * s + 2] = grad_w[s];
}

// One query-head's gradients: dq (D) and doff (Ko, 3) written; dkb, dvb (this plane's token 0 of
// the gradient buffers) accumulated.
template <bool OFF, int DC, typename T>
SLIDE_INLINE void backward_one(const Geometry& g, const Samples<T>& S, Work<T>& Wk, const T* q, const T* kb,
                               const T* vb, const T* dout, T lse, T delta, T* dq, T* dkb, T* dvb, T* doff) {
  const T scale = T(g.scale);
  T *score = Wk.score.data(), *dP = Wk.dP.data();  // dP[cell]: d loss / d (weight of that value)
  row_scores_and_dp<DC>(q, dout, kb, vb, S.rows.data(), S.cells.data(), S.size, scale, score, dP, dim<DC>(g));
  T *p = Wk.prob.data(), *ds = Wk.dlogit.data();
  if (!OFF) {
#pragma omp simd
    for (int64_t s = 0; s < g.K; ++s) {
      p[s] = softmax_exp(score[s] - lse);
      ds[s] = p[s] * (dP[s] - delta) * scale;
    }
  } else if (g.Ko == 1) {
    slot_terms<true>(g, S, Wk, lse, delta, doff);
  } else {
    slot_terms<false>(g, S, Wk, lse, delta, doff);
  }
  spread_pair<OFF>(g, S, p, ds, Wk.pair.data());
  row_gradients<DC>(q, dout, kb, S.rows.data(), S.cells.data(), S.size, Wk.pair.data(), dq, dkb, dvb, dim<DC>(g));
}

// The kernel's tensors (contiguous). Outputs: out, lse (forward); dq, dk, dv, doff (backward).
template <typename T>
struct Ptrs {
  const T *q, *k, *v, *off, *lse, *delta, *dout;
  T *out_w, *lse_w, *dq, *dk, *dv, *doff;
};

// Walks query-heads in plane-major order (r = plane * N + n, n in grid order), keeping the grid
// position and offsets current without a division per query.
struct Cursor {
  int64_t t, h, w, n, plane, b, head;
  SLIDE_INLINE Cursor(const Geometry& g, int64_t r) {
    const int64_t N = g.tokens();
    plane = r / N, n = r % N, b = plane / g.heads, head = plane % g.heads;
    t = n / (g.H * g.W), h = (n / g.W) % g.H, w = n % g.W;
  }
  SLIDE_INLINE void next(const Geometry& g) {
    ++n;
    if (++w < g.W) return;
    w = 0;
    if (++h < g.H) return;
    h = 0;
    if (++t < g.T) return;
    t = 0, n = 0, ++plane;
    b = plane / g.heads, head = plane % g.heads;
  }
  SLIDE_INLINE int64_t qh(const Geometry& g) const { return (b * g.tokens() + n) * g.heads + head; }  // (B, N, heads) index
  SLIDE_INLINE int64_t plane_base(const Geometry& g) const { return b * g.tokens() * g.row() + head * g.D; }
};

// A query-head with a NaN offset gets NaN out and lse, as the reference gives and as a NaN input
// gives in any torch op (its points are read at 0 meanwhile, keeping every read inside the grid);
// the backward carries the NaN on through lse. Returns how many such query-heads it saw.
template <bool OFF, int DC, typename T>
SLIDE_INLINE int32_t forward_range(const Geometry& g, const Slots& slots, const Ptrs<T>& x, int64_t begin, int64_t end) {
  Samples<T> S(g);
  Work<T> Wk(g);
  Cursor at(g, begin);
  int32_t non_finite = 0;
  for (int64_t r = begin; r < end; ++r, at.next(g)) {
    const int64_t qh = at.qh(g), row = qh * g.D, base = at.plane_base(g);
    S.non_finite = 0;
    if (OFF) offset_samples(g, slots, at.t, at.h, at.w, x.off + qh * g.Ko * 3, S);
    else window_samples(g, at.t, at.h, at.w, S);
    forward_one<OFF, DC>(g, S, Wk, x.q + row, x.k + base, x.v + base, x.out_w + row, x.lse_w + qh);
    if (OFF && S.non_finite) {
      std::fill(x.out_w + row, x.out_w + row + g.D, std::numeric_limits<T>::quiet_NaN());
      x.lse_w[qh] = std::numeric_limits<T>::quiet_NaN();
      ++non_finite;
    }
  }
  return non_finite;
}

// dk, dv: the gradient buffers this range adds into.
template <bool OFF, int DC, typename T>
SLIDE_INLINE void backward_range(const Geometry& g, const Slots& slots, const Ptrs<T>& x, T* dk, T* dv, int64_t begin,
                                 int64_t end) {
  Samples<T> S(g);
  Work<T> Wk(g);
  Cursor at(g, begin);
  for (int64_t r = begin; r < end; ++r, at.next(g)) {
    const int64_t qh = at.qh(g), row = qh * g.D, base = at.plane_base(g);
    if (OFF) offset_samples(g, slots, at.t, at.h, at.w, x.off + qh * g.Ko * 3, S);
    else window_samples(g, at.t, at.h, at.w, S);
    backward_one<OFF, DC>(g, S, Wk, x.q + row, x.k + base, x.v + base, x.dout + row, x.lse[qh], x.delta[qh], x.dq + row,
                          dk + base, dv + base, OFF ? x.doff + qh * g.Ko * 3 : nullptr);
  }
}

// Entry points compiled once per instruction set (see SLIDE_CLONES); the loader picks the best.
#define SLIDE_ENTRIES(T, DC)                                                                                  \
  SLIDE_CLONES int32_t forward_##T##_##DC(const Geometry& g, const Slots& sl, const Ptrs<T>& x, int64_t b,    \
                                          int64_t e) {                                                       \
    return g.has_off ? forward_range<true, DC>(g, sl, x, b, e) : forward_range<false, DC>(g, sl, x, b, e);   \
  }                                                                                                          \
  SLIDE_CLONES void backward_##T##_##DC(const Geometry& g, const Slots& sl, const Ptrs<T>& x, T* dk, T* dv,   \
                                        int64_t b, int64_t e) {                                              \
    if (g.has_off) backward_range<true, DC>(g, sl, x, dk, dv, b, e);                                         \
    else backward_range<false, DC>(g, sl, x, dk, dv, b, e);                                                  \
  }
SLIDE_ENTRIES(float, 0)
SLIDE_ENTRIES(float, 32)
SLIDE_ENTRIES(float, 64)
SLIDE_ENTRIES(float, 128)
SLIDE_ENTRIES(double, 0)

template <typename T>
int32_t forward_rows(const Geometry& g, const Slots& sl, const Ptrs<T>& x, int64_t b, int64_t e) {
  if constexpr (std::is_same_v<T, float>) {
    if (g.D == 32) return forward_float_32(g, sl, x, b, e);
    if (g.D == 64) return forward_float_64(g, sl, x, b, e);
    if (g.D == 128) return forward_float_128(g, sl, x, b, e);
    return forward_float_0(g, sl, x, b, e);
  } else {
    return forward_double_0(g, sl, x, b, e);
  }
}

template <typename T>
void backward_rows(const Geometry& g, const Slots& sl, const Ptrs<T>& x, T* dk, T* dv, int64_t b, int64_t e) {
  if constexpr (std::is_same_v<T, float>) {
    if (g.D == 32) return backward_float_32(g, sl, x, dk, dv, b, e);
    if (g.D == 64) return backward_float_64(g, sl, x, dk, dv, b, e);
    if (g.D == 128) return backward_float_128(g, sl, x, dk, dv, b, e);
    return backward_float_0(g, sl, x, dk, dv, b, e);
  } else {
    return backward_double_0(g, sl, x, dk, dv, b, e);
  }
}

Geometry geometry(const torch::Tensor& q, const torch::Tensor& off, int64_t kt, int64_t kh, int64_t kw, double scale) {
  Geometry g{q.size(0), q.size(1), q.size(2), q.size(3), q.size(4), q.size(5), kt, kh, kw, kt * kh * kw, 1,
             off.numel() > 0, scale};
  if (g.has_off) g.Ko = off.size(5);
  return g;
}

constexpr int64_t GRAIN = 256;  // query-heads per task when queries are split

// Whole planes per thread when they split evenly (or are many): no shared gradient rows.
bool planes_per_thread(const Geometry& g, int64_t threads) {
  return threads == 1 || (g.planes() >= threads && (g.planes() % threads == 0 || g.planes() >= 4 * threads));
}

template <typename T>
void run_forward(const Geometry& g, const Ptrs<T>& x) {
  const Slots sl(g);
  at::parallel_for(0, g.planes() * g.tokens(), GRAIN, [&](int64_t b, int64_t e) { forward_rows(g, sl, x, b, e); });
}

template <typename T>
void run_backward(const Geometry& g, const Ptrs<T>& x, torch::Tensor& dk, torch::Tensor& dv) {
  const Slots sl(g);
  const int64_t threads = std::max(1, at::get_num_threads()), N = g.tokens();
  if (planes_per_thread(g, threads)) {
    T *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>();
    at::parallel_for(0, g.planes(), 1, [&](int64_t b, int64_t e) { backward_rows(g, sl, x, dkp, dvp, b * N, e * N); });
    return;
  }
  const int64_t numel = dk.numel();
  auto dk_all = torch::zeros({threads, numel}, dk.options()), dv_all = torch::zeros({threads, numel}, dv.options());
  T *dka = dk_all.data_ptr<T>(), *dva = dv_all.data_ptr<T>();
  at::parallel_for(0, g.planes() * N, GRAIN, [&](int64_t b, int64_t e) {
    const int64_t tid = at::get_thread_num();
    TORCH_CHECK(tid < threads, "slide_cpu: more threads than gradient buffers");
    backward_rows(g, sl, x, dka + tid * numel, dva + tid * numel, b, e);
  });
  dk.copy_(dk_all.sum(0).view(dk.sizes()));
  dv.copy_(dv_all.sum(0).view(dv.sizes()));
}

// Fresh output buffers are first touched here, one page fault per 4 KiB (the per-sample offsets'
// gradient holds heads x K x 3 values per token: hundreds of MB for a mid-sized clip). Asking for
// transparent huge pages (2 MiB) on the large ones makes 512 times fewer faults; it is only a hint,
// harmless where THP is off.
torch::Tensor huge_pages(torch::Tensor t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const auto bytes = static_cast<uintptr_t>(t.numel() * t.element_size());
  if (bytes >= 2 * kHuge) {
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto start = (reinterpret_cast<uintptr_t>(t.data_ptr()) + page - 1) / page * page;
    const auto end = reinterpret_cast<uintptr_t>(t.data_ptr()) + bytes;
    if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
  }
#endif
  return t;
}

}  // namespace

// Returns (out, lse); `offsets` is an empty tensor for neighbourhood attention.
std::vector<torch::Tensor> slide_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor offsets,
                                         int64_t kt, int64_t kh, int64_t kw, double scale) {
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous(), offsets = offsets.contiguous();
  const Geometry g = geometry(q, offsets, kt, kh, kw, scale);
  auto out = huge_pages(torch::empty_like(q));
  auto lse = torch::empty(q.sizes().slice(0, 5), q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "slide_forward", [&] {
    Ptrs<scalar_t> x{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                     g.has_off ? offsets.data_ptr<scalar_t>() : nullptr, nullptr, nullptr, nullptr,
                     out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), nullptr, nullptr, nullptr, nullptr};
    run_forward<scalar_t>(g, x);
  });
  return {out, lse};
}

// Returns (dq, dk, dv, doffsets); doffsets is empty without offsets. delta = rowsum(dout * out) - dlse.
std::vector<torch::Tensor> slide_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor offsets,
                                          torch::Tensor lse, torch::Tensor delta, torch::Tensor dout, int64_t kt,
                                          int64_t kh, int64_t kw, double scale) {
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous(), offsets = offsets.contiguous();
  lse = lse.contiguous(), delta = delta.to(q.scalar_type()).contiguous(), dout = dout.contiguous();
  const Geometry g = geometry(q, offsets, kt, kh, kw, scale);
  auto dq = huge_pages(torch::empty_like(q));
  auto dk = huge_pages(torch::empty_like(q)).zero_();
  auto dv = huge_pages(torch::empty_like(q)).zero_();
  auto doff = huge_pages(torch::empty_like(offsets));  // every query-head writes its (Ko, 3) block
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "slide_backward", [&] {
    Ptrs<scalar_t> x{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                     g.has_off ? offsets.data_ptr<scalar_t>() : nullptr, lse.data_ptr<scalar_t>(),
                     delta.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), nullptr, nullptr, dq.data_ptr<scalar_t>(),
                     nullptr, nullptr, g.has_off ? doff.data_ptr<scalar_t>() : nullptr};
    run_backward<scalar_t>(g, x, dk, dv);
  });
  return {dq, dk, dv, doff};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &slide_forward, "slide attention forward (out, lse)");
  m.def("backward", &slide_backward, "slide attention backward (dq, dk, dv, doffsets)");
}
