// Log-probabilities and entropy from existing logits, forward and backward. Torch-free.
//
// Math, per row n (z = logits[n, :] / tau in fp32, y = labels[n]):
//   lse  = log sum_v e^(z_v)                         (online: running max, rescaled sums)
//   logp = z_y - lse
//   H    = lse - sum_v p_v z_v = log s - t / s        (s, t: see LseState in common.cuh)
// Backward, with upstream g = dL/dlogp[n] and g_H = dL/dH[n]:
//   dlogp/dz_v = [v == y] - p_v,   dH/dz_v = -p_v (log p_v + H)
//   dL/dlogits[n, v] = (g ([v == y] - p_v) - g_H p_v (log p_v + H)) / tau
// Rows with y == ignore_index are not read: logp = H = lse = 0 and their gradient row is 0
// (their lse is never used: the gradient of an ignored row does not depend on it). A label
// outside [0, V) that is not ignore_index (value checks off) is never used as an index:
// logp = NaN, gradient row 0 (the GPU rule of README "Numerics").
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
//   backward  2 N V s bytes (read + write)      (bf16, same shape: 2.49 GB)
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

// Online statistics of thread `tid`'s share of one row of logits, scaled by 1 / tau.
template <typename T, int BLOCK, bool WITH_ENT>
MRTPO_HD LseState logprobs_row_partial(const T* row, int64_t vocab, float inv_temp,
                                       int64_t tid) {
  LseState st = LseState::empty();
  auto push = [&](int64_t, float x) { st.template push<WITH_ENT>(x * inv_temp); };
  for_each_in_row<T, BLOCK, kLogprobsUnroll>(row, vocab, tid, push);
  return st;
}

// logp, entropy, lse of one row from its merged statistics. Labels are range-checked on the
// Python side; an out-of-range one (checks disabled) gives NaN rather than a stray read.
template <typename T, bool WITH_ENT>
MRTPO_HD void logprobs_row_finish(const LseState& st, const T* row, int64_t vocab, int64_t y,
                                  float inv_temp, float* logp, float* entropy, float* lse) {
  const float log_s = fast_log(st.s);
  *lse = st.m + log_s;
  // (z_y - m) - log s, not z_y - lse: no rounding of lse at large |m|.
  *logp = (y >= 0 && y < vocab) ? (to_float(row[y]) * inv_temp - st.m) - log_s : NAN;
  if (WITH_ENT) *entropy = st.entropy();
}

// dL/dlogit of element v (raw logit x) of a row with label y, lse l, entropy h; upstream
// gradients g (log-prob) and gh (entropy).
template <bool WITH_ENT>
MRTPO_HD float logprobs_grad_elem(int64_t v, float x, int64_t y, float l, float h, float g,
                                  float gh, float inv_temp) {
  const float lp = x * inv_temp - l;  // log p_v
  const float p = fast_exp(lp);
  float d = (v == y ? g : 0.f) - p * g;
  // p = 0 (a -inf logit) contributes nothing; skipping avoids 0 * -inf.
  if (WITH_ENT) d -= (p > 0.f) ? gh * p * (lp + h) : 0.f;
  return d * inv_temp;
}

// Thread `tid`'s share of one row of the backward: out = dL/dlogits (zeros when ignored).
template <typename T, int BLOCK, bool WITH_ENT>
MRTPO_HD void logprobs_bwd_row(const T* row, T* out, int64_t vocab, int64_t y, bool ignored,
                               float l, float h, float g, float gh, float inv_temp,
                               int64_t tid) {
  if (ignored) {
    auto zero = [](int64_t, float) { return 0.f; };
    map_row<T, BLOCK, kLogprobsUnroll, false>(nullptr, out, vocab, tid, zero);
    return;
  }
  auto grad = [&](int64_t v, float x) {
    return logprobs_grad_elem<WITH_ENT>(v, x, y, l, h, g, gh, inv_temp);
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
    st = block_allreduce<BLOCK>(st, LseMerge(), scratch);
    if (threadIdx.x == 0) {
      logprobs_row_finish<T, WITH_ENT>(st, z, vocab, y, inv_temp, logp + row,
                                       WITH_ENT ? entropy + row : nullptr, lse + row);
    }
  }
}

template <typename T, int BLOCK, bool WITH_ENT>
__global__ void __launch_bounds__(BLOCK)
    logprobs_bwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                        const float* __restrict__ lse, const float* __restrict__ entropy,
                        const float* __restrict__ grad_logp,
                        const float* __restrict__ grad_entropy, int64_t n_rows, int64_t vocab,
                        float inv_temp, int64_t ignore_index, T* __restrict__ grad_logits) {
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const int64_t y = labels[row];
    // an out-of-range label (value checks off) gets a zero gradient, like an ignored row
    // (its forward log-prob is NaN): no index, and no -p g row from a label never matched
    const bool ignored = y == ignore_index || y < 0 || y >= vocab;
    const float l = ignored ? 0.f : lse[row];
    const float g = ignored ? 0.f : grad_logp[row];
    const float h = WITH_ENT && !ignored ? entropy[row] : 0.f;
    const float gh = WITH_ENT && !ignored ? grad_entropy[row] : 0.f;
    logprobs_bwd_row<T, BLOCK, WITH_ENT>(logits + row * vocab, grad_logits + row * vocab, vocab,
                                         y, ignored, l, h, g, gh, inv_temp, threadIdx.x);
  }
}

}  // namespace cuda
}  // namespace mrtpo
