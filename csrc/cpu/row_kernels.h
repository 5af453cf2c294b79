// Per-row reductions over one token's logits, the inner loops of the CPU backend. Torch-free.
//
// Every function reads one row z[0..V) of raw logits (before the temperature; a = z / tau)
// that a BLAS GEMM just wrote, in fp32 (or fp64 for gradcheck), and streams over it 1-3
// times while it sits in L2 (a 151936-entry fp32 row is 594 KiB). No temporaries.
//
//   stats:   m = max a, s = sum exp(a - m), u = sum exp(a - m)(a - m)
//            lse = m + log s, logp = a_y - lse, H = log s - u / s            (2 passes)
//   grad:    dz_v = (g_lp ([v == y] - p_v) - g_H p_v (log p_v + H)) / tau      (1 pass)
//   js:      with a = log p, b = log q (both lse known), per element
//              p log(p/M) + q log(q/M) = M h(t),  M = (p + q) / 2, t = (p - q) / (p + q),
//              h(t) = (1+t) log(1+t) + (1-t) log(1-t) = sum_k t^(2k) / (k (2k - 1)),
//            the series for |t| < 1/4 (no cancellation: every term >= 0, t = 0 gives
//            exactly 0), else p (ln2 + a - log(p+q)) + q (ln2 + b - log(p+q));
//            JSD = sum / 2, d = sqrt(JSD / ln 2) clamped to [0, 1]              (3-5 passes)
//   policy:  stats, then the clipped-surrogate gradient dL/dlogp times the token weight,
//            written into the row as dL/dz (exp(a - m) kept from the sum pass)  (3 passes)
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "vec_math.h"

#if defined(__GNUC__)
#define MRTPO_INLINE inline __attribute__((always_inline))
#else
#define MRTPO_INLINE inline
#endif

namespace mrtpo {

constexpr double kLn2 = 0.69314718055994530942;

template <typename T>
MRTPO_INLINE T row_max(const T* z, int64_t V, T inv_t) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) m = z[v] > m ? z[v] : m;
  return m * inv_t;  // inv_t > 0, so max(z) / tau = max(z / tau)
}

// Returns s = sum exp(a - m) and, through u, sum exp(a - m) (a - m).
template <typename T>
MRTPO_INLINE T row_sum_exp(const T* z, int64_t V, T inv_t, T m, T* u, bool want_u) {
  T s = 0, t = 0;
  if (want_u) {
#pragma omp simd reduction(+ : s, t)
    for (int64_t v = 0; v < V; ++v) {
      const T x = z[v] * inv_t - m;
      const T e = vexp(x);
      s += e;
      t += e > T(0) ? e * x : T(0);  // masked (-inf) logits: 0, not 0 * inf
    }
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t v = 0; v < V; ++v) s += vexp(z[v] * inv_t - m);
  }
  *u = t;
  return s;
}

struct RowStats {
  double lse, logp, entropy;
};

template <typename T>
MRTPO_INLINE RowStats row_stats(const T* z, int64_t V, T inv_t, int64_t label, bool with_ent) {
  const T m = row_max(z, V, inv_t);
  T u;
  const T s = row_sum_exp(z, V, inv_t, m, &u, with_ent);
  const double log_s = std::log(static_cast<double>(s));
  RowStats r;
  r.lse = static_cast<double>(m) + log_s;
  r.logp = label >= 0 ? static_cast<double>(z[label] * inv_t) - r.lse : 0.0;
  r.entropy = with_ent ? log_s - static_cast<double>(u) / static_cast<double>(s) : 0.0;
  return r;
}

// In place: z <- dL/dz for L = g_lp logp + g_ent H (label < 0: the row is ignored, zeros).
template <typename T>
MRTPO_INLINE void row_grad(T* z, int64_t V, T inv_t, int64_t label, T lse, T ent, T g_lp,
                           T g_ent) {
  if (label < 0) {
    for (int64_t v = 0; v < V; ++v) z[v] = 0;
    return;
  }
  const T c_ent = g_ent * inv_t;
  const T c_lp = g_lp * inv_t;
  if (g_ent != 0) {
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) {
      const T lp = z[v] * inv_t - lse;
      const T p = vexp(lp);
      z[v] = p > T(0) ? -p * (c_lp + c_ent * (lp + ent)) : T(0);
    }
  } else {
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) z[v] = -vexp(z[v] * inv_t - lse) * c_lp;
  }
  z[label] += c_lp;
}

template <typename T>
MRTPO_INLINE T row_lse(const T* z, int64_t V, T inv_t) {
  const T m = row_max(z, V, inv_t);
  T u;
  const T s = row_sum_exp(z, V, inv_t, m, &u, false);
  return m + static_cast<T>(std::log(static_cast<double>(s)));
}

// JS distance between the rows zp and zq whose log-normalizers are lse_p and lse_q.
template <typename T>
MRTPO_INLINE T row_js(const T* zp, const T* zq, int64_t V, T inv_t, T lse_p, T lse_q) {
  const T ln2 = static_cast<T>(kLn2);
  const T tiny = std::numeric_limits<T>::min();
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t v = 0; v < V; ++v) {
    const T a = zp[v] * inv_t - lse_p;
    const T b = zq[v] * inv_t - lse_q;
    const T p = vexp(a);
    const T q = vexp(b);
    const T s = p + q;
    const T s_safe = s > tiny ? s : T(1);
    const T t = (p - q) / s_safe;
    const T t2 = t * t;
    // h(t) / t^2 = 1 + t^2/6 + t^4/15 + t^6/28 + t^8/45 + t^10/66 (+ O(t^12) < 1e-8 here)
    T h = T(1) / 66;
    h = h * t2 + T(1) / 45;
    h = h * t2 + T(1) / 28;
    h = h * t2 + T(1) / 15;
    h = h * t2 + T(1) / 6;
    h = h * t2 + T(1);
    const T series = T(0.5) * s * t2 * h;
    const T log_s = vlog(s_safe);
    // p = 0 (a logit of -inf, or an underflow) contributes 0, not 0 * inf
    const T direct = (p > T(0) ? p * (ln2 + a - log_s) : T(0)) +
                     (q > T(0) ? q * (ln2 + b - log_s) : T(0));
    const T term = t2 < T(0.0625) ? series : direct;
    acc += s > tiny ? term : T(0);
  }
  T jsd = T(0.5) * acc;
  jsd = jsd > T(0) ? jsd : T(0);
  T d = std::sqrt(jsd / ln2);
  return d < T(1) ? d : T(1);
}

struct PolicyOut {
  double loss, logp, clipped;
};

// Clipped surrogate for one token; with need_grad, z <- token_weight * dL/dz in place.
template <typename T>
MRTPO_INLINE PolicyOut row_policy(T* z, int64_t V, T inv_t, int64_t label, T old_lp, T adv,
                                  T weight, bool has_ref, T ref_lp, T clip_low, T clip_high,
                                  T beta, bool need_grad) {
  PolicyOut o{0.0, 0.0, 0.0};
  if (label < 0) {
    if (need_grad)
      for (int64_t v = 0; v < V; ++v) z[v] = 0;
    return o;
  }
  const T m = row_max(z, V, inv_t);
  T s = 0;
  const T z_label = z[label];
  if (need_grad) {
    // keep e_v = exp(a_v - m) in the row: the gradient pass needs p_v = e_v / s
#pragma omp simd reduction(+ : s)
    for (int64_t v = 0; v < V; ++v) {
      const T e = vexp(z[v] * inv_t - m);
      z[v] = e;
      s += e;
    }
  } else {
    T u;
    s = row_sum_exp(z, V, inv_t, m, &u, false);
  }
  const double lse = static_cast<double>(m) + std::log(static_cast<double>(s));
  const double logp = static_cast<double>(z_label * inv_t) - lse;
  const double ratio = std::exp(logp - static_cast<double>(old_lp));
  const double a = static_cast<double>(adv);
  const double lo = 1.0 - static_cast<double>(clip_low), hi = 1.0 + static_cast<double>(clip_high);
  const double cr = ratio < lo ? lo : (ratio > hi ? hi : ratio);
  const bool unclipped = ratio * a <= cr * a;
  double loss = -(unclipped ? ratio * a : cr * a);
  double dlogp = unclipped ? -a * ratio : 0.0;
  if (has_ref && beta != 0) {
    const double diff = static_cast<double>(ref_lp) - logp;
    loss += static_cast<double>(beta) * (std::exp(diff) - diff - 1.0);
    dlogp += static_cast<double>(beta) * (1.0 - std::exp(diff));
  }
  o.loss = loss;
  o.logp = logp;
  o.clipped = unclipped ? 0.0 : 1.0;
  if (need_grad) {
    const T g = static_cast<T>(dlogp * static_cast<double>(weight)) * inv_t;
    const T c = -g / s;
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) z[v] *= c;
    z[label] += g;
  }
  return o;
}

}  // namespace mrtpo
