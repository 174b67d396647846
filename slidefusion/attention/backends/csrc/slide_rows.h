// Row math of the slide attention CPU kernel (`slide_cpu.cpp`): dot products and axpys over the
// D numbers of one (token, head) row, and the softmax over a query's slots. Included once, inside
// that file's anonymous namespace, after SLIDE_INLINE and Geometry are defined.

// Head sizes compiled with a constant D (fully unrolled rows); others use DC = 0, a runtime D.
template <int DC>
SLIDE_INLINE int64_t dim(const Geometry& g) { return DC > 0 ? DC : g.D; }

// Rows of D numbers. float rows of a constant D (a multiple of 16) use GCC vector extensions:
// one 16-float vector per 64 bytes, which each clone lowers to AVX-512, AVX2 or SSE. (Left to
// itself GCC neither keeps these accumulators in registers nor reduces a dot product in a tree.)
// Everything else runs plain loops over a runtime D.
#if defined(__GNUC__)
typedef float v16f __attribute__((vector_size(64)));
typedef float v16f_unaligned __attribute__((vector_size(64), aligned(4), may_alias));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
template <int DC, typename T>
constexpr bool kVector = std::is_same_v<T, float> && DC > 0 && DC % 16 == 0;

SLIDE_INLINE v16f vload(const float* p) { return *reinterpret_cast<const v16f_unaligned*>(p); }
SLIDE_INLINE void vstore(float* p, v16f x) { *reinterpret_cast<v16f_unaligned*>(p) = x; }
SLIDE_INLINE float hsum(v16f v) {
  const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const v4f c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return c[0] + c[1];
}
// Both sums of x and y with one shared reduction tree (the backward takes two dot products per token).
SLIDE_INLINE void hsum2(v16f x, v16f y, float& sx, float& sy) {
  const v16f s = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v8f a = __builtin_shufflevector(s, s, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(s, s, 4, 5, 6, 7, 12, 13, 14, 15);  // x in 0-3, y in 4-7
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 4, 5) + __builtin_shufflevector(a, a, 2, 3, 6, 7);
  sx = b[0] + b[1];
  sy = b[2] + b[3];
}
// A row held in registers.
template <int DC>
struct Reg {
  v16f x[DC / 16];
  SLIDE_INLINE static Reg load(const float* p) {
    Reg r;
    for (int i = 0; i < DC / 16; ++i) r.x[i] = vload(p + 16 * i);
    return r;
  }
  SLIDE_INLINE static Reg zero() {
    Reg r;
    for (int i = 0; i < DC / 16; ++i) r.x[i] = v16f{};
    return r;
  }
  SLIDE_INLINE void store(float* p) const {
    for (int i = 0; i < DC / 16; ++i) vstore(p + 16 * i, x[i]);
  }
  SLIDE_INLINE float dot(const float* p) const {
    v16f s = x[0] * vload(p);
    for (int i = 1; i < DC / 16; ++i) s += x[i] * vload(p + 16 * i);
    return hsum(s);
  }
  // this . p and other . o, reduced together.
  SLIDE_INLINE void dot2(const float* p, const Reg& other, const float* o, float& sp, float& so) const {
    v16f a = x[0] * vload(p), b = other.x[0] * vload(o);
    for (int i = 1; i < DC / 16; ++i) a += x[i] * vload(p + 16 * i), b += other.x[i] * vload(o + 16 * i);
    hsum2(a, b, sp, so);
  }
  SLIDE_INLINE void add(float alpha, const float* p) {  // this += alpha * row p
    for (int i = 0; i < DC / 16; ++i) x[i] += alpha * vload(p + 16 * i);
  }
  SLIDE_INLINE void add_to(float alpha, float* p) const {  // row p += alpha * this
    for (int i = 0; i < DC / 16; ++i) vstore(p + 16 * i, vload(p + 16 * i) + alpha * x[i]);
  }
};
#else
template <int DC, typename T>
constexpr bool kVector = false;
template <int DC>
struct Reg {};
#endif

template <typename T>
SLIDE_INLINE T dot(const T* __restrict a, const T* __restrict b, int64_t D) {
  T s = 0;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

template <typename T>
SLIDE_INLINE void axpy(T alpha, const T* __restrict x, T* __restrict y, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] += alpha * x[d];
}

// The per-token loops run over the U tokens whose scores are needed: token j is row rows[j]
// (element offset into k, v and their gradients) and owns entry cells[j] of the per-token arrays.

// score[cells[j]] = scale * q . k(rows[j]).
template <int DC, typename T>
SLIDE_INLINE void row_scores(const T* q, const T* kb, const int64_t* rows, const int32_t* cells, int64_t U, T scale,
                             T* score, int64_t D) {
  if constexpr (kVector<DC, T>) {
    const auto qr = Reg<DC>::load(q);
    for (int64_t j = 0; j < U; ++j) score[cells[j]] = scale * qr.dot(kb + rows[j]);
  } else {
    for (int64_t j = 0; j < U; ++j) score[cells[j]] = scale * dot(q, kb + rows[j], D);
  }
}

// out = sum_j w[cells[j]] v(rows[j]).
template <int DC, typename T>
SLIDE_INLINE void weighted_rows(const T* w, const T* vb, const int64_t* rows, const int32_t* cells, int64_t U, T* out,
                                int64_t D) {
  if constexpr (kVector<DC, T>) {
    auto acc = Reg<DC>::zero();
    for (int64_t j = 0; j < U; ++j) acc.add(w[cells[j]], vb + rows[j]);
    acc.store(out);
  } else {
    std::fill(out, out + D, T(0));
    for (int64_t j = 0; j < U; ++j) axpy(w[cells[j]], vb + rows[j], out, D);
  }
}

// score[cells[j]] = scale * q . k(rows[j]) and dP[cells[j]] = dout . v(rows[j]).
template <int DC, typename T>
SLIDE_INLINE void row_scores_and_dp(const T* q, const T* dout, const T* kb, const T* vb, const int64_t* rows,
                                    const int32_t* cells, int64_t U, T scale, T* score, T* dP, int64_t D) {
  if constexpr (kVector<DC, T>) {
    const auto qr = Reg<DC>::load(q), dr = Reg<DC>::load(dout);
    for (int64_t j = 0; j < U; ++j) {
      float s, d;
      qr.dot2(kb + rows[j], dr, vb + rows[j], s, d);
      score[cells[j]] = scale * s;
      dP[cells[j]] = d;
    }
  } else {
    for (int64_t j = 0; j < U; ++j) {
      score[cells[j]] = scale * dot(q, kb + rows[j], D);
      dP[cells[j]] = dot(dout, vb + rows[j], D);
    }
  }
}

// With c = cells[j], (A, ds) = (pair[2c], pair[2c + 1]): dq = sum_j ds k(rows[j]);
// dk(rows[j]) += ds q; dv(rows[j]) += A dout.
template <int DC, typename T>
SLIDE_INLINE void row_gradients(const T* q, const T* dout, const T* kb, const int64_t* rows, const int32_t* cells,
                                int64_t U, const T* pair, T* dq, T* dkb, T* dvb, int64_t D) {
  if constexpr (kVector<DC, T>) {
    const auto qr = Reg<DC>::load(q), dr = Reg<DC>::load(dout);
    auto acc = Reg<DC>::zero();
    for (int64_t j = 0; j < U; ++j) {
      const int64_t at = rows[j];
      const T a = pair[2 * cells[j]], d = pair[2 * cells[j] + 1];
      acc.add(d, kb + at);
      qr.add_to(d, dkb + at);
      dr.add_to(a, dvb + at);
    }
    acc.store(dq);
  } else {
    std::fill(dq, dq + D, T(0));
    for (int64_t j = 0; j < U; ++j) {
      const int64_t at = rows[j];
      const T a = pair[2 * cells[j]], d = pair[2 * cells[j] + 1];
      axpy(d, kb + at, dq, D);
      axpy(d, q, dkb + at, D);
      axpy(a, dout, dvb + at, D);
    }
  }
}

// exp(x) for the softmax's x = logit - max (or - lse), <= 0 up to rounding. float: Cephes' expf
// polynomial (relative error ~1e-7), branch-free so that the loops calling it vectorise; x is
// clamped at -87 (exp = 1.6e-38; the max's own term is 1, so such terms are lost to rounding
// anyway) and must stay below 88. double: the library exp.
SLIDE_INLINE float softmax_exp(float x) {
  x = x > -87.0f ? x : -87.0f;
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: plain arithmetic, unlike floorf, which in the
  // baseline compilation of this inline code becomes a library call and stops the vectoriser.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}
SLIDE_INLINE double softmax_exp(double x) { return std::exp(x); }

// Softmax of z (K) in place; returns its log-sum-exp.
template <typename T>
SLIDE_INLINE T softmax(T* z, int64_t K) {
  T m = z[0];
#pragma omp simd reduction(max : m)
  for (int64_t s = 0; s < K; ++s) m = z[s] > m ? z[s] : m;  // a select, not std::max's branch: it vectorises
  T l = 0;
#pragma omp simd reduction(+ : l)
  for (int64_t s = 0; s < K; ++s) {
    z[s] = softmax_exp(z[s] - m);
    l += z[s];
  }
  const T inv = T(1) / l;
#pragma omp simd
  for (int64_t s = 0; s < K; ++s) z[s] *= inv;
  return m + std::log(l);
}
