// Per-token Jensen-Shannon distance from existing logits, one P row against K Q rows.
// Torch-free.
//
// Math, per token n and stream k (z_p = logits_p[n], z_q = logits_q[k, n], raw):
//   P = softmax(z_p / tau), Q = softmax(z_q / tau), M = (P + Q) / 2
//   JSD = 1/2 KL(P || M) + 1/2 KL(Q || M) = 1/2 sum_v m_v h(t_v)
//   with m = (p + q) / 2, t = (p - q) / (p + q) in [-1, 1] and
//   h(t) = (1 + t) log(1 + t) + (1 - t) log(1 - t) = sum_{j >= 1} t^(2j) / (j (2j - 1))
//   d = sqrt(max(JSD, 0) / ln 2), clamped to [0, 1]
// Every term needs both log-normalizers, so the row is read twice:
//   pass 1: the log-normalizers (online raw max / sum), P's shared by all K streams, each
//           kept as raw max and log(sum) (LogNorm) so that log p = (z - max) / tau - log(sum)
//           (common.cuh scaled_diff: no z / tau, no overflow) stays exact at large |z / tau|;
//   pass 2: sum_v m_v h(t_v).
// Numerics of one term: t = tanh(delta / 2) with delta = log p - log q, each log formed
// from its own row's normalizer: exactly 0 for identical rows, no cancellation between two
// large logits. For |delta / 2| < 1/4 the tanh and
// h series (errors below 1e-8 relative) avoid the cancellation in h for t -> 0; otherwise
//   m h(t) = p (ln 2 + log p - log(p + q)) + q (ln 2 + log q - log(p + q))
// with the p = 0 or q = 0 terms dropped (disjoint supports give d = 1 exactly in exact math).
//
// Shapes and dtypes: logits_p (N, V), logits_q (K, N, V), both row-major contiguous, in the
// same dtype (fp32 / bf16 / fp16); out (K, N) fp32. N, K, V are run-time values.
//
// Launch: one CTA per token n (grid-stride), handling the K streams in groups of KB (1 or
// 4, a template parameter so the per-stream state lives in registers). Pass 1 of the first
// group also reads P; later groups reuse P's log-normalizer.
//
// Cost (s = sizeof(dtype)): bytes read 2 (1 + K) N V s for K <= KB, plus N V s per extra
// group of KB streams. The second pass does not hit L2 at these sizes (the rows in flight on
// 132 SMs exceed the 50 MB L2), so both passes come from HBM. FLOPs: pass 1 one exp per
// element, pass 2 two exps and at most one log per (p, q) pair plus about 30 FMAs.
// H200 target (4.8 TB/s): >= 75% of bandwidth at N >= 1024, e.g. bf16, N = 4096,
// V = 151936, K = 1: 4.98 GB in about 1.4 ms; K = 4: 12.4 GB in about 3.5 ms.
// (A single-read variant would keep the P and Q rows in the distributed shared memory of a
// thread-block cluster between the passes: 600 KB per row pair in bf16 fits 8 SMs.)
#pragma once

#include "common.cuh"

namespace mrtpo {
namespace cuda {

constexpr int kJsBlock = 512;
constexpr int kJsUnroll = 2;

// R = 1 + KB running (max, sum) pairs, merged as one state.
template <int R>
struct MaxSumArray {
  MaxSum v[R];
};

template <int R>
struct MaxSumArrayMerge {
  float two_inv_t;
  MRTPO_HD MaxSumArray<R> operator()(const MaxSumArray<R>& a,
                                                       const MaxSumArray<R>& b) const {
    MaxSumArray<R> out;
    MaxSumMerge merge{two_inv_t};
MRTPO_UNROLL
    for (int r = 0; r < R; ++r) out.v[r] = merge(a.v[r], b.v[r]);
    return out;
  }
};

template <int KB>
struct FloatArray {
  float v[KB];
};

template <int KB>
struct FloatArraySum {
  MRTPO_HD FloatArray<KB> operator()(const FloatArray<KB>& a,
                                                       const FloatArray<KB>& b) const {
    FloatArray<KB> out;
MRTPO_UNROLL
    for (int k = 0; k < KB; ++k) out.v[k] = a.v[k] + b.v[k];
    return out;
  }
};

// tanh(u) for |u| < 1/4: u - u^3/3 + 2u^5/15 - 17u^7/315 + 62u^9/2835 (error < 1e-8 relative).
MRTPO_HD float tanh_small(float u) {
  const float u2 = u * u;
  float c = 62.f / 2835.f;
  c = fmaf(c, u2, -17.f / 315.f);
  c = fmaf(c, u2, 2.f / 15.f);
  c = fmaf(c, u2, -1.f / 3.f);
  c = fmaf(c, u2, 1.f);
  return u * c;
}

// h(t) = (1 + t) log(1 + t) + (1 - t) log(1 - t) for |t| < 0.245: the series
// t^2 + t^4/6 + t^6/15 + t^8/28 + t^10/45 (next term below 1e-8 relative).
MRTPO_HD float h_small(float t) {
  const float t2 = t * t;
  float c = 1.f / 45.f;
  c = fmaf(c, t2, 1.f / 28.f);
  c = fmaf(c, t2, 1.f / 15.f);
  c = fmaf(c, t2, 1.f / 6.f);
  c = fmaf(c, t2, 1.f);
  return t2 * c;
}

// m h(t) for one vocabulary entry from lp = log p, p = e^lp and lq = log q (each from its own
// row's raw max and log-sum, LogNorm::log_prob), and delta = log p - log q formed from the
// raw logits first (js_delta): exactly 0 for identical rows, and for close rows free of the
// rounding of lp and lq.
MRTPO_HD float js_term(float lp, float p, float lq, float delta) {
  const float q = fast_exp(lq);
  const float pq = p + q;
  if (!(pq > 0.f)) return 0.f;  // both underflow: m = 0
  const float half_delta = 0.5f * delta;
  if (p > 0.f && q > 0.f && fabsf(half_delta) < 0.25f) {
    return 0.5f * pq * h_small(tanh_small(half_delta));
  }
  const float log_pq = fast_log(pq);
  const float tp = p > 0.f ? p * (kLn2 + lp - log_pq) : 0.f;
  const float tq = q > 0.f ? q * (kLn2 + lq - log_pq) : 0.f;
  return tp + tq;
}

// delta = log p - log q in the form with the smaller rounding error: from the raw
// differences ((z_p - z_q) - (m_p - m_q)) / tau - (log s_p - log s_q) (in halves: no overflow)
// where those are small next to |lp| + |lq| (close rows: exactly 0 for identical ones, free
// of the rounding of lp and lq), else lp - lq (rows of different scales, where the raw form
// would cancel two huge terms). dmh = (m_p - m_q) / 2, dls = log s_p - log s_q.
MRTPO_HD float js_delta(float zp, float zq, float lp, float lq, float dmh, float dls,
                        float two_inv_t) {
  const float dz = 0.5f * zp - 0.5f * zq;
  const bool raw_ok = (fabsf(dz) + fabsf(dmh)) * two_inv_t <= fabsf(lp) + fabsf(lq);
  return raw_ok ? (dz - dmh) * two_inv_t - dls : lp - lq;
}

// d from the summed m h(t): JSD = sum / 2; NaN propagates (a NaN logit gives NaN).
MRTPO_HD float js_distance_from_sum(float sum) {
  float jsd = 0.5f * sum;
  jsd = jsd < 0.f ? 0.f : jsd;
  const float d = sqrtf(jsd / kLn2);
  return d > 1.f ? 1.f : d;
}

// x[r] = element v of row r as fp32 for the rows in `mask`, 0 for the others.
template <typename T, int R>
MRTPO_HD void load_rows_at(const T* const (&rows)[R], unsigned mask, int64_t v, float (&x)[R]) {
MRTPO_UNROLL
  for (int r = 0; r < R; ++r) x[r] = ((mask >> r) & 1u) ? to_float(load_elem(rows[r] + v)) : 0.f;
}

// Call f(v, x) for every element v owned by thread `tid` of R rows at once (x[r]: row r's
// element as fp32, 0 for rows not in `mask`). Vectorized when all rows in `mask` share their
// 16-byte misalignment, else scalar.
// f may be a host-only callable (the CPU harness); the check is per instantiation.
#pragma nv_exec_check_disable
template <typename T, int BLOCK, int UNROLL, int R, typename F>
MRTPO_HD void for_each_in_rows(const T* const (&rows)[R], unsigned mask, int64_t vocab,
                               int64_t tid, F& f) {
  constexpr int kVec = Pack<T>::kSize;
  unsigned mis = 16u;
  bool same = true;
MRTPO_UNROLL
  for (int r = 0; r < R; ++r) {
    if ((mask >> r) & 1u) {
      const unsigned m = misalignment16(rows[r]);
      same = same && (mis == 16u || m == mis);
      mis = m;
    }
  }
  float x[R];
  if (!same) {
    for (int64_t v = tid; v < vocab; v += BLOCK) {
      load_rows_at(rows, mask, v, x);
      f(v, x);
    }
    return;
  }
  const RowSplit sp = RowSplit::make<T>(mis == 16u ? 0u : mis, vocab);
  for (int64_t v = tid; v < sp.head; v += BLOCK) {
    load_rows_at(rows, mask, v, x);
    f(v, x);
  }
  int64_t i = tid;
  for (; i + (UNROLL - 1) * BLOCK < sp.nvec; i += UNROLL * BLOCK) {
    Pack<T> pk[UNROLL][R];
MRTPO_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
MRTPO_UNROLL
      for (int r = 0; r < R; ++r) {
        if ((mask >> r) & 1u) pk[u][r] = load_pack(rows[r] + sp.head + (i + u * BLOCK) * kVec);
      }
    }
MRTPO_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t v0 = sp.head + (i + u * BLOCK) * kVec;
MRTPO_UNROLL
      for (int e = 0; e < kVec; ++e) {
MRTPO_UNROLL
        for (int r = 0; r < R; ++r) x[r] = to_float(pk[u][r].elem[e]);
        f(v0 + e, x);
      }
    }
  }
  for (; i < sp.nvec; i += BLOCK) {
    Pack<T> pk[R];
MRTPO_UNROLL
    for (int r = 0; r < R; ++r) {
      if ((mask >> r) & 1u) pk[r] = load_pack(rows[r] + sp.head + i * kVec);
    }
    const int64_t v0 = sp.head + i * kVec;
MRTPO_UNROLL
    for (int e = 0; e < kVec; ++e) {
MRTPO_UNROLL
      for (int r = 0; r < R; ++r) x[r] = to_float(pk[r].elem[e]);
      f(v0 + e, x);
    }
  }
  for (int64_t v = sp.tail_begin + tid; v < vocab; v += BLOCK) {
    load_rows_at(rows, mask, v, x);
    f(v, x);
  }
}

// ---- per-thread pieces (host-device: the CPU harness runs them one simulated thread at a time)

// Rows of token `row` for the group of streams [k0, k0 + kb): rows[0] = P, rows[1 + j] = Q
// stream k0 + j (P again as a never-read placeholder for j >= kb).
template <typename T, int KB>
MRTPO_HD void js_group_rows(const T* logits_p, const T* logits_q, int64_t row, int64_t n_rows,
                            int64_t vocab, int64_t k0, int kb, const T* (&rows)[1 + KB]) {
  rows[0] = logits_p + row * vocab;
MRTPO_UNROLL
  for (int j = 0; j < KB; ++j) {
    rows[1 + j] = j < kb ? logits_q + ((k0 + j) * n_rows + row) * vocab : rows[0];
  }
}

// Pass 1: running (max, sum) of the scaled logits of the rows in `mask`, thread tid's share.
template <typename T, int BLOCK, int R>
MRTPO_HD MaxSumArray<R> js_pass1_partial(const T* const (&rows)[R], unsigned mask, int64_t vocab,
                                         float inv_temp, int64_t tid) {
  const float two_inv_t = 2.f * inv_temp;
  MaxSumArray<R> st;
MRTPO_UNROLL
  for (int r = 0; r < R; ++r) st.v[r] = MaxSum::empty();
  auto push = [&](int64_t, const float (&x)[R]) {
MRTPO_UNROLL
    for (int r = 0; r < R; ++r) {
      if ((mask >> r) & 1u) st.v[r].push(x[r], two_inv_t);
    }
  };
  for_each_in_rows<T, BLOCK, kJsUnroll, R>(rows, mask, vocab, tid, push);
  return st;
}

// Pass 2: sum of m h(t) of P against each of the kb Q rows, thread tid's share.
template <typename T, int BLOCK, int KB>
MRTPO_HD FloatArray<KB> js_pass2_partial(const T* const (&rows)[1 + KB], int kb, int64_t vocab,
                                         float inv_temp, const LogNorm& np,
                                         const LogNorm (&nq)[KB],
                                         int64_t tid) {
  constexpr int R = 1 + KB;
  FloatArray<KB> acc;
MRTPO_UNROLL
  for (int j = 0; j < KB; ++j) acc.v[j] = 0.f;
  const float two_inv_t = 2.f * inv_temp;
  float dmh[KB], dls[KB];  // per stream: (m_p - m_q) / 2 and log s_p - log s_q
MRTPO_UNROLL
  for (int j = 0; j < KB; ++j) {
    dmh[j] = 0.5f * np.m - 0.5f * nq[j].m;
    dls[j] = np.log_s - nq[j].log_s;
  }
  auto accumulate = [&](int64_t, const float (&x)[R]) {
    const float lp = np.log_prob(x[0], two_inv_t);
    const float p = fast_exp(lp);
MRTPO_UNROLL
    for (int j = 0; j < KB; ++j) {
      if (j < kb) {
        const float lq = nq[j].log_prob(x[1 + j], two_inv_t);
        acc.v[j] += js_term(lp, p, lq, js_delta(x[0], x[1 + j], lp, lq, dmh[j], dls[j],
                                                two_inv_t));
      }
    }
  };
  const unsigned mask = (((1u << kb) - 1u) << 1) | 1u;
  for_each_in_rows<T, BLOCK, kJsUnroll, R>(rows, mask, vocab, tid, accumulate);
  return acc;
}

// A row with a NaN or +inf (log s NaN) or nothing but -inf (m = -inf) has no distribution:
// its JS distance is NaN, never the 0 that js_term's both-underflow rule would sum to
// (README "Numerics").
MRTPO_HD bool js_row_defined(const LogNorm& a, const LogNorm& b) {
  // |x| <= FLT_MAX is false for NaN and +-inf (a comparison: no library call, fast-math safe)
  constexpr float kMax = 3.402823466e38f;
  return fabsf(a.m) <= kMax && fabsf(a.log_s) <= kMax && fabsf(b.m) <= kMax &&
         fabsf(b.log_s) <= kMax;
}

// ---- kernel

// out[k, n] = JS distance between softmax(logits_p[n] / tau) and softmax(logits_q[k, n] / tau).
template <typename T, int BLOCK, int KB>
// (BLOCK, 1): without the minimum, ptxas capped the fp16 KB = 1 variant at 40 registers and
// spilled; one CTA of BLOCK threads per SM is all the bound has to guarantee.
__global__ void __launch_bounds__(BLOCK, 1)
    js_kernel(const T* __restrict__ logits_p, const T* __restrict__ logits_q, int64_t n_rows,
              int64_t n_streams, int64_t vocab, float inv_temp, float* __restrict__ out) {
  constexpr int R = 1 + KB;  // row 0: P; rows 1..KB: a group of Q streams
  __shared__ MaxSumArray<R> scratch1[BLOCK / kWarpSize];
  __shared__ FloatArray<KB> scratch2[BLOCK / kWarpSize];
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    LogNorm np{0.f, 0.f};
    for (int64_t k0 = 0; k0 < n_streams; k0 += KB) {
      const int kb = static_cast<int>(n_streams - k0 < KB ? n_streams - k0 : KB);
      const T* rows[R];
      js_group_rows<T, KB>(logits_p, logits_q, row, n_rows, vocab, k0, kb, rows);
      // Pass 1: log-normalizers (P's only in the first group).
      const unsigned mask1 = (((1u << kb) - 1u) << 1) | (k0 == 0 ? 1u : 0u);
      MaxSumArray<R> st =
          js_pass1_partial<T, BLOCK, R>(rows, mask1, vocab, inv_temp, threadIdx.x);
      st = block_allreduce<BLOCK>(st, MaxSumArrayMerge<R>{2.f * inv_temp}, scratch1);
      if (k0 == 0) np = st.v[0].log_norm();
      LogNorm nq[KB];
MRTPO_UNROLL
      for (int j = 0; j < KB; ++j) nq[j] = st.v[1 + j].log_norm();
      // Pass 2: sum_v m_v h(t_v) for each stream of the group.
      FloatArray<KB> acc =
          js_pass2_partial<T, BLOCK, KB>(rows, kb, vocab, inv_temp, np, nq, threadIdx.x);
      acc = block_allreduce<BLOCK>(acc, FloatArraySum<KB>(), scratch2);
      if (threadIdx.x == 0) {
        // unrolled over KB with a guard: nq stays in registers (no dynamic index)
MRTPO_UNROLL
        for (int j = 0; j < KB; ++j) {
          if (j < kb) {
            out[(k0 + j) * n_rows + row] =
                js_row_defined(np, nq[j]) ? js_distance_from_sum(acc.v[j]) : NAN;
          }
        }
      }
    }
  }
}

}  // namespace cuda
}  // namespace mrtpo
