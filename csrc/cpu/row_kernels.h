// Per-row reductions over one token's logits, the inner loops of the CPU backend. Torch-free.
//
// Every function reads one row z[0..V) of raw logits (before the temperature; a = z / tau)
// that a BLAS GEMM just wrote, in fp32 (or fp64 for gradcheck), and streams over it 1-3
// times while it sits in L2 (a 151936-entry fp32 row is 594 KiB). No temporaries.
//
// Scaling: with M = max z (raw), x_v = (z_v - M) / tau = a_v - max a is formed as one
// rounded difference times the scale (shifted(): nothing an FMA can fold a rounded max
// into, and the max entry gives exactly 0). x_v <= 0 only overflows towards -inf when the
// true value is beyond the float range (p_v = 0), so finite logits whose z / tau exceeds
// the range still give exact log-probs (a row of equal values near float max at tau < 1:
// -log V); only lse = M / tau + log s may be inf.
// Non-finite rows (README "Numerics"): a NaN or a +inf anywhere, or every entry -inf, makes
// the row's outputs NaN (gradient rows too); -inf entries alone are masked (p = 0).
// Labels: y outside [0, V) (value checks off) is never used as an index: the row's log-prob
// is NaN, its gradient 0, and the drivers count such rows so the caller can raise.
//
//   stats:   x = (z - M) / tau, s = sum exp(x), u = sum exp(x) x
//            lse = M / tau + log s, logp = x_y - log s, H = log s - u / s     (2 passes)
//   grad:    recomputes M and s (the saved fp32 lse is rounded at large |M / tau|), then
//            dz_v = (g_lp ([v == y] - p_v) - g_H p_v (log p_v + H)) / tau      (3 passes)
//   js:      with a = log p, b = log q (both rows' M, log s known), per element
//              p log(p/M) + q log(q/M) = M h(t),  M = (p + q) / 2, t = (p - q) / (p + q),
//              h(t) = (1+t) log(1+t) + (1-t) log(1-t) = sum_k t^(2k) / (k (2k - 1)),
//            the series for |t| < 1/4 (no cancellation: every term >= 0, t = 0 gives
//            exactly 0), else p (ln2 + a - log(p+q)) + q (ln2 + b - log(p+q));
//            JSD = sum / 2, d = sqrt(JSD / ln 2) clamped to [0, 1]              (3-5 passes)
//   policy:  stats, then the clipped-surrogate gradient dL/dlogp times the token weight,
//            written into the row as dL/dz (exp(a - m) kept from the sum pass)  (3 passes)
//
// Logit scaling and final-logit softcapping (LogitCap): the driver transforms each chunk
// in place before these kernels read it, z = s tanh(a r / s) (or z = a r without a cap)
// of the raw logits r = h W^T + b, so every kernel sees z and the temperature as before.
// The gradient kernels (row_grad, row_policy) return dL/dr = dL/dz dz/dr with the slope
//   dz/dr = a (1 - (z / s)^2) = a (1 - z/s)(1 + z/s)   (a without a cap)
// formed from the z they read, just before they overwrite it: no extra pass, no buffer.
// Inactive (a = 1, no cap): the loops are the ones without the slope, bit for bit.
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

// The LM head's logit transform whose slope the gradient kernels apply (see the header).
template <typename T>
struct LogitCap {
  T scale = T(1);    // a, the logit scale
  T inv_cap = T(0);  // 1 / s, 0 without a softcap
  bool active() const { return scale != T(1) || inv_cap != T(0); }
};

// dz/dr at a transformed logit z: a (1 - z/s)(1 + z/s), which is a when inv_cap = 0.
template <typename T>
MRTPO_INLINE T cap_slope(T z, T scale, T inv_cap) {
  const T t = z * inv_cap;
  return scale * ((T(1) - t) * (T(1) + t));
}

// x = (z - M) / tau as (z/2 - M/2) (2/tau): halving is exact, so this is one rounded
// difference times the scale (no FMA can fold a rounded max into it, the max entry gives
// exactly 0), and z/2 - M/2 cannot overflow for finite z, M (z - M can, at tau > 1).
template <typename T>
MRTPO_INLINE T shifted(T z, T m, T inv_t) {
  return (z * T(0.5) - m * T(0.5)) * (inv_t * T(2));
}

// Raw row max M (NaN entries are skipped by the comparison) and whether the row holds NaN.
template <typename T>
MRTPO_INLINE T row_max_raw(const T* z, int64_t V, bool* has_nan) {
  T m = -std::numeric_limits<T>::infinity();
  int64_t nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
  for (int64_t v = 0; v < V; ++v) {
    m = z[v] > m ? z[v] : m;
    nans += z[v] != z[v] ? 1 : 0;
  }
  *has_nan = nans > 0;
  return m;
}

// A row with a NaN, a +inf, or nothing but -inf (M = -inf) has no defined distribution.
template <typename T>
MRTPO_INLINE bool row_defined(T m, bool has_nan) {
  return !has_nan && m > -std::numeric_limits<T>::infinity() &&
         m < std::numeric_limits<T>::infinity();
}

// Returns s = sum exp(x) and, through u, sum exp(x) x, with x = (z - m) inv_t.
template <typename T>
MRTPO_INLINE T row_sum_exp(const T* z, int64_t V, T inv_t, T m, T* u, bool want_u) {
  T s = 0, t = 0;
  if (want_u) {
#pragma omp simd reduction(+ : s, t)
    for (int64_t v = 0; v < V; ++v) {
      const T x = shifted(z[v], m, inv_t);
      const T e = vexp(x);
      s += e;
      t += e > T(0) ? e * x : T(0);  // masked (-inf) logits: 0, not 0 * inf
    }
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t v = 0; v < V; ++v) s += vexp(shifted(z[v], m, inv_t));
  }
  *u = t;
  return s;
}

// Shift statistics of one row: M (raw max) and log s; both NaN when the row is undefined.
template <typename T>
struct RowShift {
  T m;
  double log_s;
  double u_over_s;
  bool ok;
};

template <typename T>
MRTPO_INLINE RowShift<T> row_shift(const T* z, int64_t V, T inv_t, bool want_u) {
  bool has_nan;
  const T m = row_max_raw(z, V, &has_nan);
  RowShift<T> r{m, 0.0, 0.0, row_defined(m, has_nan)};
  if (!r.ok) {
    r.m = std::numeric_limits<T>::quiet_NaN();
    r.log_s = r.u_over_s = std::numeric_limits<double>::quiet_NaN();
    return r;
  }
  T u;
  const T s = row_sum_exp(z, V, inv_t, m, &u, want_u);
  r.log_s = std::log(static_cast<double>(s));
  r.u_over_s = static_cast<double>(u) / static_cast<double>(s);
  return r;
}

// Row labels as the kernels see them: kIgnoredRow (label == ignore_index), kBadLabel
// (outside [0, V) and not ignore_index), or the label itself.
constexpr int64_t kIgnoredRow = -1;
constexpr int64_t kBadLabel = -2;

static inline int64_t classify_label(int64_t y, int64_t V, int64_t ignore_index) {
  if (y == ignore_index) return kIgnoredRow;
  return y >= 0 && y < V ? y : kBadLabel;
}

static inline bool label_in_row(int64_t label, int64_t V) { return label >= 0 && label < V; }

struct RowStats {
  double lse, logp, entropy;
};

// label: from classify_label (an ignored row still gets its lse; a bad label's logp is NaN).
template <typename T>
MRTPO_INLINE RowStats row_stats(const T* z, int64_t V, T inv_t, int64_t label, bool with_ent) {
  const RowShift<T> sh = row_shift(z, V, inv_t, with_ent);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  RowStats r;
  r.lse = sh.ok ? static_cast<double>(sh.m * inv_t) + sh.log_s : nan;
  if (label == kIgnoredRow) {
    r.logp = 0.0;
  } else if (!label_in_row(label, V) || !sh.ok) {
    r.logp = nan;
  } else {
    r.logp = static_cast<double>(shifted(z[label], sh.m, inv_t)) - sh.log_s;
  }
  r.entropy = with_ent ? sh.log_s - sh.u_over_s : 0.0;
  return r;
}

// In place: z <- dL/dz for L = g_lp logp + g_ent H (dL/dr with an active cap). An ignored row or a bad label:
// the row is zeros. An undefined row (NaN / +inf / all -inf) becomes NaN.
template <typename T>
MRTPO_INLINE void row_grad(T* z, int64_t V, T inv_t, int64_t label, T ent, T g_lp, T g_ent,
                           const LogitCap<T>& cap) {
  if (!label_in_row(label, V)) {
    for (int64_t v = 0; v < V; ++v) z[v] = 0;
    return;
  }
  const RowShift<T> sh = row_shift(z, V, inv_t, false);
  if (!sh.ok) {
    for (int64_t v = 0; v < V; ++v) z[v] = std::numeric_limits<T>::quiet_NaN();
    return;
  }
  const T m = sh.m;
  const T log_s = static_cast<T>(sh.log_s);
  const T c_ent = g_ent * inv_t;
  const T c_lp = g_lp * inv_t;
  if (cap.active()) {  // dL/dr = dL/dz * slope(z), the slope from z before it is overwritten
    const T a = cap.scale, ic = cap.inv_cap;
    const T slope_y = cap_slope(z[label], a, ic);
    if (g_ent != 0) {
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) {
        const T lp = shifted(z[v], m, inv_t) - log_s;
        const T p = vexp(lp);
        const T dz = p > T(0) ? -p * (c_lp + c_ent * (lp + ent)) : T(0);
        z[v] = dz * cap_slope(z[v], a, ic);
      }
    } else {
#pragma omp simd
      for (int64_t v = 0; v < V; ++v)
        z[v] = -vexp(shifted(z[v], m, inv_t) - log_s) * c_lp * cap_slope(z[v], a, ic);
    }
    z[label] += c_lp * slope_y;
    return;
  }
  if (g_ent != 0) {
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) {
      const T lp = shifted(z[v], m, inv_t) - log_s;
      const T p = vexp(lp);
      z[v] = p > T(0) ? -p * (c_lp + c_ent * (lp + ent)) : T(0);
    }
  } else {
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) z[v] = -vexp(shifted(z[v], m, inv_t) - log_s) * c_lp;
  }
  z[label] += c_lp;
}

// The JS sum's terms for one element: p, q, their log-probabilities a, b. For p close to q
// (t = (p - q) / (p + q) small) the series in t keeps the digits the direct form cancels.
template <typename T>
MRTPO_INLINE T js_term(T a, T b, T p, T q) {
  const T ln2 = static_cast<T>(kLn2);
  const T tiny = std::numeric_limits<T>::min();
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
  return s > tiny ? term : T(0);
}

// The distance from the JS sum acc = sum of js_term: sqrt(JSD / ln 2) in [0, 1].
template <typename T>
MRTPO_INLINE T js_from_sum(T acc) {
  T jsd = T(0.5) * acc;
  jsd = jsd < T(0) ? T(0) : jsd;  // (NaN stays NaN)
  const T d = std::sqrt(jsd / static_cast<T>(kLn2));
  return d > T(1) ? T(1) : d;
}

// JS distance between the rows zp and zq with shift statistics (mp, lsp), (mq, lsq);
// NaN when either row is undefined (a NaN shift statistic).
template <typename T>
MRTPO_INLINE T row_js(const T* zp, const T* zq, int64_t V, T inv_t, T mp, T lsp, T mq, T lsq) {
  if (mp != mp || lsp != lsp || mq != mq || lsq != lsq)
    return std::numeric_limits<T>::quiet_NaN();
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t v = 0; v < V; ++v) {
    const T a = shifted(zp[v], mp, inv_t) - lsp;
    const T b = shifted(zq[v], mq, inv_t) - lsq;
    acc += js_term(a, b, vexp(a), vexp(b));
  }
  return js_from_sum(acc);
}

// row_js with P's log-probabilities pa and probabilities pp given, and Q's exps qe (before
// the division by their sum; inv_sum = 1 / that sum, lsq = log of it).
template <typename T>
MRTPO_INLINE T js_terms(const T* pa, const T* pp, const T* zq, const T* qe, int64_t V, T inv_t,
                        T mq, T lsq, T inv_sum) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t v = 0; v < V; ++v) {
    const T b = shifted(zq[v], mq, inv_t) - lsq;
    acc += js_term(pa[v], b, pp[v], qe[v] * inv_sum);
  }
  return js_from_sum(acc);
}

struct PolicyOut {
  double loss, logp, clipped;
};

// The k3 KL term exp(d) - d - 1 of d = ref - logp without its cancellation (the plain form
// keeps no digit of it at |d| ~ 1e-8 in double): sum_{n >= 2} d^n / n! through 1/16! for
// |d| < 1/2, expm1(d) - d beyond; the reference's form (reference.kl_k3_ref). NaN stays NaN.
MRTPO_INLINE double kl_k3(double d) {
  if (!(std::fabs(d) < 0.5)) return std::expm1(d) - d;
  double poly = 1.0 / 20922789888000.0;  // 1/16!
  double fact = 20922789888000.0;
  for (int n = 16; n > 2; --n) {
    fact /= n;  // (n-1)!, exact in double
    poly = poly * d + 1.0 / fact;
  }
  return d * d * poly;
}

// Clipped surrogate for one token; with need_grad, z <- token_weight * dL/dz in place
// (dL/dr with an active cap).
// An ignored row or a bad label: gradient 0; a bad label: loss and logp NaN.
// clip_c: the dual clip (a token with A < 0 has its loss capped at -A clip_c, gradient 0
// where the cap binds; +inf: none). kl_iw: the k3 term times the ratio r (not detached),
// whose derivative r k3 + r (1 - exp(ref - logp)) is r (logp - ref). The clip rule is the
// reference's, NaN and ties included (see the comment at the clip below).
template <typename T>
MRTPO_INLINE PolicyOut row_policy(T* z, int64_t V, T inv_t, int64_t label, T old_lp, T adv,
                                  T weight, bool has_ref, T ref_lp, T clip_low, T clip_high,
                                  T beta, T clip_c, bool kl_iw, bool need_grad,
                                  const LogitCap<T>& cap) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (!label_in_row(label, V)) {
    if (need_grad)
      for (int64_t v = 0; v < V; ++v) z[v] = 0;
    return label == kIgnoredRow ? PolicyOut{0.0, 0.0, 0.0} : PolicyOut{nan, nan, 0.0};
  }
  bool has_nan;
  const T m = row_max_raw(z, V, &has_nan);
  if (!row_defined(m, has_nan)) {
    if (need_grad)
      for (int64_t v = 0; v < V; ++v) z[v] = std::numeric_limits<T>::quiet_NaN();
    return PolicyOut{nan, nan, 0.0};
  }
  T s = 0;
  const T x_label = shifted(z[label], m, inv_t);
  // with an active cap the gradient pass needs z itself (its slope), so e is not kept
  const bool keep_e = need_grad && !cap.active();
  if (keep_e) {
    // keep e_v = exp(x_v) in the row: the gradient pass needs p_v = e_v / s
#pragma omp simd reduction(+ : s)
    for (int64_t v = 0; v < V; ++v) {
      const T e = vexp(shifted(z[v], m, inv_t));
      z[v] = e;
      s += e;
    }
  } else {
    T u;
    s = row_sum_exp(z, V, inv_t, m, &u, false);
  }
  const double logp = static_cast<double>(x_label) - std::log(static_cast<double>(s));
  const double ratio = std::exp(logp - static_cast<double>(old_lp));
  const double a = static_cast<double>(adv);
  const double lo = 1.0 - static_cast<double>(clip_low), hi = 1.0 + static_cast<double>(clip_high);
  const double cr = ratio < lo ? lo : (ratio > hi ? hi : ratio);  // NaN stays NaN
  // the reference's rule (reference.policy_loss_ref and its autograd): clipped iff
  // ratio A > clamp(ratio) A, strictly; a tie (any ratio inside the range, or A = 0) or a
  // NaN is not clipped. L = -min(ratio A, clamp(ratio) A) with NaN in, NaN out (a NaN
  // surrogate, e.g. A = 0 with ratio inf, never falls back to the finite side);
  // dL/dlogp = -A ratio unless clipped: a tie passes the whole gradient, a NaN passes NaN.
  const double ua = ratio * a, ca = cr * a;
  const bool clipped = ua > ca;
  double loss = -(clipped ? ca : ua);
  double dlogp = clipped ? 0.0 : -a * ratio;
  const double dual_cap = -a * static_cast<double>(clip_c);  // -inf: clip_c = inf, a > 0
  if (a < 0 && loss > dual_cap) {
    loss = dual_cap;
    dlogp = 0.0;
  }
  if (has_ref && beta != 0) {
    const double diff = static_cast<double>(ref_lp) - logp;
    const double k3 = kl_k3(diff);
    const double b = static_cast<double>(beta);
    if (kl_iw) {
      loss += b * ratio * k3;
      dlogp -= b * ratio * diff;
    } else {
      loss += b * k3;
      dlogp -= b * (diff + k3);  // 1 - exp(d) = -(d + k3), without the cancellation
    }
  }
  PolicyOut o;
  o.loss = loss;
  o.logp = logp;
  o.clipped = clipped ? 1.0 : 0.0;  // clip_fraction counts the same flag
  if (need_grad) {
    const T g = static_cast<T>(dlogp * static_cast<double>(weight)) * inv_t;
    const T c = -g / s;
    if (keep_e) {
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) z[v] *= c;
      z[label] += g;
    } else {  // dL/dr = (g [v == y] - g p_v) slope(z_v), p_v = exp(x_v) / s
      const T sc = cap.scale, ic = cap.inv_cap;
      const T slope_y = cap_slope(z[label], sc, ic);
#pragma omp simd
      for (int64_t v = 0; v < V; ++v)
        z[v] = c * vexp(shifted(z[v], m, inv_t)) * cap_slope(z[v], sc, ic);
      z[label] += g * slope_y;
    }
  }
  return o;
}

}  // namespace mrtpo
