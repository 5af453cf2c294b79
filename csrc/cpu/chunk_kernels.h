// Row-range drivers over a [C, V] chunk of logits, compiled once per x86 ISA level
// (AVX-512, AVX2+FMA, baseline) with GCC target_clones and picked at load time, so one
// wheel is fast on every x86-64 CPU without -march=native. Torch-free.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "row_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MRTPO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MRTPO_CLONES
#endif

namespace mrtpo {

// Each driver returns the number of rows whose label is outside [0, V) and not
// ignore_index (such a label is never used as an index; see row_kernels.h).

template <typename T>
MRTPO_INLINE int64_t stats_rows(const T* z, int64_t V, T inv_t, const int64_t* labels,
                                int64_t ignore_index, bool with_ent, T* logp, T* ent, T* lse,
                                int64_t begin, int64_t end) {
  int64_t bad = 0;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t y = classify_label(labels[r], V, ignore_index);
    bad += y == kBadLabel;
    const RowStats st = row_stats(z + r * V, V, inv_t, y, with_ent);
    lse[r] = static_cast<T>(st.lse);
    logp[r] = static_cast<T>(st.logp);
    if (with_ent) ent[r] = y == kIgnoredRow ? T(0) : static_cast<T>(st.entropy);
  }
  return bad;
}

template <typename T>
MRTPO_INLINE int64_t grad_rows(T* z, int64_t V, T inv_t, const int64_t* labels,
                               int64_t ignore_index, const T* ent, const T* g_lp, const T* g_ent,
                               int64_t begin, int64_t end, const LogitCap<T>& cap) {
  int64_t bad = 0;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t y = classify_label(labels[r], V, ignore_index);
    bad += y == kBadLabel;
    row_grad(z + r * V, V, inv_t, y, ent ? ent[r] : T(0), g_lp[r], g_ent ? g_ent[r] : T(0), cap);
  }
  return bad;
}

// stat_p ([rows, 2]: raw max M, log s of each P row) is read when have_stat_p, else
// computed and written.
template <typename T>
MRTPO_INLINE void js_rows(const T* zp, const T* zq, int64_t V, T inv_t, T* stat_p,
                          bool have_stat_p, T* out, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* p = zp + r * V;
    const T* q = zq + r * V;
    if (!have_stat_p) {
      const RowShift<T> sp = row_shift(p, V, inv_t, false);
      stat_p[2 * r] = sp.m;
      stat_p[2 * r + 1] = static_cast<T>(sp.log_s);
    }
    const RowShift<T> sq = row_shift(q, V, inv_t, false);
    out[r] = row_js(p, q, V, inv_t, stat_p[2 * r], stat_p[2 * r + 1], sq.m,
                    static_cast<T>(sq.log_s));
  }
}

// Of one row z of V logits: its raw max M (NaN where the row has no distribution:
// row_defined) and, in e, exp((z - M) / tau) per logit; returns their sum.
template <typename T>
MRTPO_INLINE T row_exps(const T* z, int64_t V, T inv_t, T* e, T* m_out) {
  bool has_nan;
  const T m = row_max_raw(z, V, &has_nan);
  if (!row_defined(m, has_nan)) {
    *m_out = std::numeric_limits<T>::quiet_NaN();
    return T(0);
  }
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; ++v) {
    const T x = vexp(shifted(z[v], m, inv_t));
    e[v] = x;
    sum += x;
  }
  *m_out = m;
  return sum;
}

// One-vs-many on stacked rows z [S = 1 + K, C, V] (stream 0 = P); out [K, C]. Per token
// row r, P's log-probabilities a and probabilities p into two scratch rows (one exp per
// logit, not one per stream); then per Q_j its exps into a third scratch row while they are
// summed, and the JS terms from the scratch rows with no exp (p = e_p / s_p, q = e_q / s_q,
// the same arithmetic on both sides, so that equal rows give exactly 0). 3 + 1 / K exps per
// logit and stream became 1 + 1 / K. The scratch rows (3 V) stay in cache while the K
// streams read them.
template <typename T>
MRTPO_INLINE void js_many_rows(const T* z, int64_t S, int64_t C, int64_t V, T inv_t, T* out,
                               int64_t begin, int64_t end) {
  std::vector<T> scratch(static_cast<size_t>(3 * V));
  T* pa = scratch.data();  // a = log p
  T* pp = pa + V;          // p
  T* qe = pp + V;          // exp((z_q - M_q) / tau), before the division by its sum
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t r = begin; r < end; ++r) {
    const T* zp = z + r * V;
    T mp;
    const T sum_p = row_exps(zp, V, inv_t, pp, &mp);
    if (mp != mp) {  // no distribution for P: every distance of the row is NaN
      for (int64_t j = 1; j < S; ++j) out[(j - 1) * C + r] = nan;
      continue;
    }
    const T lsp = static_cast<T>(std::log(static_cast<double>(sum_p)));
    const T inv_p = T(1) / sum_p;
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) {
      pa[v] = shifted(zp[v], mp, inv_t) - lsp;
      pp[v] *= inv_p;
    }
    for (int64_t j = 1; j < S; ++j) {
      const T* zq = z + (j * C + r) * V;
      T mq;
      const T sum_q = row_exps(zq, V, inv_t, qe, &mq);
      if (mq != mq) {
        out[(j - 1) * C + r] = nan;
        continue;
      }
      const T lsq = static_cast<T>(std::log(static_cast<double>(sum_q)));
      out[(j - 1) * C + r] = js_terms(pa, pp, zq, qe, V, inv_t, mq, lsq, T(1) / sum_q);
    }
  }
}

template <typename T>
MRTPO_INLINE int64_t policy_rows(T* z, int64_t V, T inv_t, const int64_t* labels,
                                 int64_t ignore_index, const T* old_lp, const T* adv,
                                 const T* weight, const T* ref_lp, T clip_low, T clip_high,
                                 T beta, T clip_c, bool kl_iw, bool need_grad, T* loss,
                                 T* logp, T* clipped, int64_t begin, int64_t end,
                                 const LogitCap<T>& cap) {
  int64_t bad = 0;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t y = classify_label(labels[r], V, ignore_index);
    bad += y == kBadLabel;
    const PolicyOut o = row_policy(z + r * V, V, inv_t, y, old_lp[r], adv[r], weight[r],
                                   ref_lp != nullptr, ref_lp ? ref_lp[r] : T(0), clip_low,
                                   clip_high, beta, clip_c, kl_iw, need_grad, cap);
    loss[r] = static_cast<T>(o.loss);
    logp[r] = static_cast<T>(o.logp);
    clipped[r] = static_cast<T>(o.clipped);
  }
  return bad;
}

// fp32 entry points, one clone per ISA level (defined in chunk_kernels.cpp).
int64_t stats_rows_f32(const float* z, int64_t V, float inv_t, const int64_t* labels,
                       int64_t ignore_index, bool with_ent, float* logp, float* ent, float* lse,
                       int64_t begin, int64_t end);
int64_t grad_rows_f32(float* z, int64_t V, float inv_t, const int64_t* labels,
                      int64_t ignore_index, const float* ent, const float* g_lp,
                      const float* g_ent, int64_t begin, int64_t end,
                      const LogitCap<float>& cap);
void js_rows_f32(const float* zp, const float* zq, int64_t V, float inv_t, float* stat_p,
                 bool have_stat_p, float* out, int64_t begin, int64_t end);
void js_many_rows_f32(const float* z, int64_t S, int64_t C, int64_t V, float inv_t, float* out,
                      int64_t begin, int64_t end);
int64_t policy_rows_f32(float* z, int64_t V, float inv_t, const int64_t* labels,
                     int64_t ignore_index, const float* old_lp, const float* adv,
                        const float* weight, const float* ref_lp, float clip_low,
                        float clip_high, float beta, float clip_c, bool kl_iw, bool need_grad,
                        float* loss, float* logp, float* clipped, int64_t begin, int64_t end,
                        const LogitCap<float>& cap);

}  // namespace mrtpo
