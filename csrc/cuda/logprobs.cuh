// Log-probabilities and entropy from existing logits, forward and backward. Torch-free.
//
// Math, per row n (z = logits[n, :] raw, m = max z, y = labels[n]; README "Numerics"):
//   x_v  = (z_v - m) / tau                          (common.cuh scaled_diff: no overflow)
//   log s = log sum_v e^(x_v),  lse = m / tau + log s   (online: raw running max, rescaled)
//   logp = x_y - log s
//   H    = log s - t / s,  t = sum_v e^(x_v) x_v     (see LseState in common.cuh)
// Backward, with upstream g = dL/dlogp[n] and g_H = dL/dH[n]:
//   dlogp/dz_v = ([v == y] - p_v) / tau,   dH/dz_v = -p_v (log p_v + H) / tau
//   dL/dlogits[n, v] = (g ([v == y] - p_v) - g_H p_v (log p_v + H)) / tau
// with log p_v = x_v - log s from the row's raw max and sum, recomputed by the backward (one
// more read of the row) rather than from the saved fp32 lse, whose rounding at large
// |m / tau| (1e-3 at 1e4) would pass into every p_v.
// Rows with y == ignore_index are not read: logp = H = lse = 0 and their gradient row is 0
// (their lse is never used: the gradient of an ignored row does not depend on it). A label
// outside [0, V) that is not ignore_index (value checks off) is never used as an index:
// logp = NaN, gradient row 0 (the GPU rule of README "Numerics"; logprobs_row_skipped).
//
// Shapes and dtypes: logits (N, V) row-major contiguous, fp32 / bf16 / fp16; labels (N,)
// int64; logp, entropy, lse, grad_logp, grad_entropy (N,) fp32; grad_logits (N, V) in the
// logits' dtype. N and V are run-time values; offsets are int64.
//
// Launch: one CTA of BLOCK threads per row (grid-stride over rows), 16-byte vector loads,
// fp32 online statistics per thread merged by one CTA reduction.
//
// Cost (memory-bound: a few FLOPs and one exp per element; s = sizeof(dtype)):
//   forward   N V s bytes read                  (bf16, N = 4096, V = 151936: 1.24 GB)
//   backward  3 N V s bytes (2 reads + write)   (bf16, same shape: 3.73 GB)
// On an H200 (4.8 TB/s HBM3e) the target is >= 80% of bandwidth at N >= 1024: about
// 0.32 ms forward and 0.65 ms backward at the shape above. One exp per element: bf16 at full
// bandwidth is 2.4e12 elements/s against 4.2e12 exp/s of the MUFU units (16 per clock per
// SM, 132 SMs, 1.98 GHz), about 1.7x headroom forward and 3.5x backward. For N below the
// number of SMs one CTA per row leaves most of the GPU idle: there the kernel is
// latency-bound (tens of microseconds for a 151936-entry row on one SM).
#pragma once

#include "common.cuh"

namespace mrtpo {
namespace cuda {

constexpr int kLogprobsBlock = 512;
constexpr int kLogprobsUnroll = 2;

// ---- per-thread pieces (host-device: the CPU harness runs them one simulated thread at a time)

// Online statistics of thread `tid`'s share of one row of logits at temperature 1 / inv_temp.
template <typename T, int BLOCK, bool WITH_ENT>
MRTPO_HD LseState logprobs_row_partial(const T* row, int64_t vocab, float inv_temp,
                                       int64_t tid) {
  const float two_inv_t = 2.f * inv_temp;
  LseState st = LseState::empty();
  auto push = [&](int64_t, float x) { st.template push<WITH_ENT>(x, two_inv_t); };
  for_each_in_row<T, BLOCK, kLogprobsUnroll>(row, vocab, tid, push);
  return st;
}

// The backward's recompute: thread `tid`'s share of the row's raw max and sum.
template <typename T, int BLOCK>
MRTPO_HD MaxSum logprobs_row_norm_partial(const T* row, int64_t vocab, float inv_temp,
                                          int64_t tid) {
  const float two_inv_t = 2.f * inv_temp;
  MaxSum st = MaxSum::empty();
  auto push = [&](int64_t, float x) { st.push(x, two_inv_t); };
  for_each_in_row<T, BLOCK, kLogprobsUnroll>(row, vocab, tid, push);
  return st;
}

// A row the backward leaves at zero: an ignored label, or one outside [0, V) (value checks
// off; its forward log-prob is NaN): no index, and no -p g row from a label never matched.
MRTPO_HD bool logprobs_row_skipped(int64_t y, int64_t ignore_index, int64_t vocab) {
  return y == ignore_index || y < 0 || y >= vocab;
}

// logp, entropy, lse of one row from its merged statistics. Labels are range-checked on the
// Python side; an out-of-range one (checks disabled) gives NaN rather than a stray read.
template <typename T, bool WITH_ENT>
MRTPO_HD void logprobs_row_finish(const LseState& st, const T* row, int64_t vocab, int64_t y,
                                  float inv_temp, float* logp, float* entropy, float* lse) {
  const float log_s = fast_log(st.s);
  *lse = st.m * inv_temp + log_s;
  // (z_y - m) / tau - log s, not z_y / tau - lse: no rounding of lse, no overflow of z / tau.
  *logp = (y >= 0 && y < vocab) ? LogNorm{st.m, log_s}.log_prob(to_float(row[y]), 2.f * inv_temp)
                                : NAN;
  if (WITH_ENT) *entropy = st.entropy();
}

// dL/dlogit of element v (raw logit x) of a row with label y, log-normalizer nz (raw max,
// log sum), entropy h; upstream gradients g (log-prob) and gh (entropy).
template <bool WITH_ENT>
MRTPO_HD float logprobs_grad_elem(int64_t v, float x, int64_t y, const LogNorm& nz, float h,
                                  float g, float gh, float inv_temp) {
  const float lp = nz.log_prob(x, 2.f * inv_temp);  // log p_v
  const float p = fast_exp(lp);
  float d = (v == y ? g : 0.f) - p * g;
  // p = 0 (a -inf logit) contributes nothing; skipping avoids 0 * -inf.
  if (WITH_ENT) d -= (p > 0.f) ? gh * p * (lp + h) : 0.f;
  return d * inv_temp;
}

// Thread `tid`'s share of one row of the backward: out = dL/dlogits (zeros when ignored).
template <typename T, int BLOCK, bool WITH_ENT>
MRTPO_HD void logprobs_bwd_row(const T* row, T* out, int64_t vocab, int64_t y, bool ignored,
                               const LogNorm& nz, float h, float g, float gh, float inv_temp,
                               int64_t tid) {
  if (ignored) {
    auto zero = [](int64_t, float) { return 0.f; };
    map_row<T, BLOCK, kLogprobsUnroll, false>(nullptr, out, vocab, tid, zero);
    return;
  }
  auto grad = [&](int64_t v, float x) {
    return logprobs_grad_elem<WITH_ENT>(v, x, y, nz, h, g, gh, inv_temp);
  };
  map_row<T, BLOCK, kLogprobsUnroll, true>(row, out, vocab, tid, grad);
}

// ---- kernels

template <typename T, int BLOCK, bool WITH_ENT>
__global__ void __launch_bounds__(BLOCK)
    logprobs_fwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                        int64_t n_rows, int64_t vocab, float inv_temp, int64_t ignore_index,
                        float* __restrict__ logp, float* __restrict__ entropy,
                        float* __restrict__ lse) {
  __shared__ LseState scratch[BLOCK / kWarpSize];
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const int64_t y = labels[row];
    if (y == ignore_index) {
      if (threadIdx.x == 0) {
        logp[row] = 0.f;
        lse[row] = 0.f;
        if (WITH_ENT) entropy[row] = 0.f;
      }
      continue;
    }
    const T* z = logits + row * vocab;
    LseState st = logprobs_row_partial<T, BLOCK, WITH_ENT>(z, vocab, inv_temp, threadIdx.x);
    st = block_allreduce<BLOCK>(st, LseMerge{2.f * inv_temp}, scratch);
    if (threadIdx.x == 0) {
      logprobs_row_finish<T, WITH_ENT>(st, z, vocab, y, inv_temp, logp + row,
                                       WITH_ENT ? entropy + row : nullptr, lse + row);
    }
  }
}

template <typename T, int BLOCK, bool WITH_ENT>
__global__ void __launch_bounds__(BLOCK)
    logprobs_bwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                        const float* __restrict__ entropy, const float* __restrict__ grad_logp,
                        const float* __restrict__ grad_entropy, int64_t n_rows, int64_t vocab,
                        float inv_temp, int64_t ignore_index, T* __restrict__ grad_logits) {
  __shared__ MaxSum scratch[BLOCK / kWarpSize];
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const int64_t y = labels[row];
    const bool ignored = logprobs_row_skipped(y, ignore_index, vocab);
    const T* z = logits + row * vocab;
    LogNorm nz{0.f, 0.f};
    if (!ignored) {  // uniform over the CTA: the reduction's barriers are reached by all
      MaxSum st = logprobs_row_norm_partial<T, BLOCK>(z, vocab, inv_temp, threadIdx.x);
      nz = block_allreduce<BLOCK>(st, MaxSumMerge{2.f * inv_temp}, scratch).log_norm();
    }
    const float g = ignored ? 0.f : grad_logp[row];
    const float h = WITH_ENT && !ignored ? entropy[row] : 0.f;
    const float gh = WITH_ENT && !ignored ? grad_entropy[row] : 0.f;
    logprobs_bwd_row<T, BLOCK, WITH_ENT>(z, grad_logits + row * vocab, vocab, y, ignored, nz, h,
                                         g, gh, inv_temp, threadIdx.x);
  }
}

}  // namespace cuda
}  // namespace mrtpo
