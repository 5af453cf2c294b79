// Row-range drivers over a [C, V] chunk of logits, compiled once per x86 ISA level
// (AVX-512, AVX2+FMA, baseline) with GCC target_clones and picked at load time, so one
// wheel is fast on every x86-64 CPU without -march=native. Torch-free.
#pragma once

#include <cstdint>

#include "row_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MRTPO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MRTPO_CLONES
#endif

namespace mrtpo {

// Row label, or -1 for an ignored row.
static inline int64_t row_label(const int64_t* labels, int64_t r, int64_t ignore_index) {
  const int64_t y = labels[r];
  return y == ignore_index ? -1 : y;
}

template <typename T>
MRTPO_INLINE void stats_rows(const T* z, int64_t V, T inv_t, const int64_t* labels,
                             int64_t ignore_index, bool with_ent, T* logp, T* ent, T* lse,
                             int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t y = row_label(labels, r, ignore_index);
    const RowStats st = row_stats(z + r * V, V, inv_t, y, with_ent);
    lse[r] = static_cast<T>(st.lse);
    logp[r] = static_cast<T>(st.logp);
    if (with_ent) ent[r] = y < 0 ? T(0) : static_cast<T>(st.entropy);
  }
}

template <typename T>
MRTPO_INLINE void grad_rows(T* z, int64_t V, T inv_t, const int64_t* labels,
                            int64_t ignore_index, const T* lse, const T* ent, const T* g_lp,
                            const T* g_ent, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t y = row_label(labels, r, ignore_index);
    row_grad(z + r * V, V, inv_t, y, lse[r], ent ? ent[r] : T(0), g_lp[r],
             g_ent ? g_ent[r] : T(0));
  }
}

// lse_p is read when have_lse_p, else computed and written.
template <typename T>
MRTPO_INLINE void js_rows(const T* zp, const T* zq, int64_t V, T inv_t, T* lse_p,
                          bool have_lse_p, T* out, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* p = zp + r * V;
    const T* q = zq + r * V;
    if (!have_lse_p) lse_p[r] = row_lse(p, V, inv_t);
    const T lse_q = row_lse(q, V, inv_t);
    out[r] = row_js(p, q, V, inv_t, lse_p[r], lse_q);
  }
}

template <typename T>
MRTPO_INLINE void policy_rows(T* z, int64_t V, T inv_t, const int64_t* labels,
                              int64_t ignore_index, const T* old_lp, const T* adv,
                              const T* weight, const T* ref_lp, T clip_low, T clip_high, T beta,
                              bool need_grad, T* loss, T* logp, T* clipped, int64_t begin,
                              int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t y = row_label(labels, r, ignore_index);
    const PolicyOut o = row_policy(z + r * V, V, inv_t, y, old_lp[r], adv[r], weight[r],
                                   ref_lp != nullptr, ref_lp ? ref_lp[r] : T(0), clip_low,
                                   clip_high, beta, need_grad);
    loss[r] = static_cast<T>(o.loss);
    logp[r] = static_cast<T>(o.logp);
    clipped[r] = static_cast<T>(o.clipped);
  }
}

// fp32 entry points, one clone per ISA level (defined in chunk_kernels.cpp).
void stats_rows_f32(const float* z, int64_t V, float inv_t, const int64_t* labels,
                    int64_t ignore_index, bool with_ent, float* logp, float* ent, float* lse,
                    int64_t begin, int64_t end);
void grad_rows_f32(float* z, int64_t V, float inv_t, const int64_t* labels, int64_t ignore_index,
                   const float* lse, const float* ent, const float* g_lp, const float* g_ent,
                   int64_t begin, int64_t end);
void js_rows_f32(const float* zp, const float* zq, int64_t V, float inv_t, float* lse_p,
                 bool have_lse_p, float* out, int64_t begin, int64_t end);
void policy_rows_f32(float* z, int64_t V, float inv_t, const int64_t* labels,
                     int64_t ignore_index, const float* old_lp, const float* adv,
                     const float* weight, const float* ref_lp, float clip_low, float clip_high,
                     float beta, bool need_grad, float* loss, float* logp, float* clipped,
                     int64_t begin, int64_t end);

}  // namespace mrtpo
