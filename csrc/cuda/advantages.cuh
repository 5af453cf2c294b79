// MRTPO token-advantage reallocation over packed responses (METHOD.md sections 4-5), one
// segmented kernel. Torch-free.
//
// Math, for response i owning tokens [cu[i], cu[i+1]) (T_i tokens) and reward k:
//   g_k[t]   = max(d_k[t], 0)^gamma
//   mean_k   = sum_t g_k[t] / T_i
//   use_k    = has_info[i, k] and mean_k >= delta        (else uniform weights w = 1)
//   w_hat[t] = g_k[t] / max(mean_k, delta)
//   clip:      w_hat = clamp(w_hat, w_min, w_max) / mean_t clamp(...)   (when enabled)
//   w_k[t]   = use_k ? (1 - alpha) + alpha w_hat[t] : 1
//   A[t]     = seq[i] + sum_{k: c_k != 0} c_k (w_k[t] - 1) / D,   c_k = lambda_k A_k[i]
// (seq[i] itself where D is not > 0): seq is GDPO's sequence advantage, D the
// redistribution's divisor (METHOD.md section 5), both read from device memory (no host
// synchronization). A weight of exactly 1, or c_k = 0, adds exactly 0: alpha = 0 is GDPO bit
// for bit. The output is final; nothing is patched after the kernel.
//
// Shapes and dtypes (all fp32 except as noted): per_reward (n, K), lam (K,), has_info (n, K)
// uint8/bool, relevance (K, N), cu_seqlens (n + 1,) int64, sequence (n,), divisor ();
// outputs token (N,) and allocation (K, N).
//
// Launch: one CTA per response (grid-stride), BLOCK threads; per reward one CTA reduction
// over the response's tokens (two with the clip), the per-reward scales kept in 2 K floats of
// dynamic shared memory, then one pass that writes allocation and token.
// Cost: relevance read 2 or 3 times, allocation and token written once: about
// (3 K + 1) N 4 bytes; tiny next to the logits (K = 4, N = 16384: 0.85 MB, a few
// microseconds, launch-bound on an H200).
#pragma once

#include "common.cuh"

namespace mrtpo {
namespace cuda {

constexpr int kReallocateBlock = 256;

struct ReallocateParams {
  float alpha;
  float gamma;
  float delta;
  float clip_min;
  float clip_max;
  bool clip;  // clip_min > 0 or clip_max finite
};

// max(d, 0)^gamma; gamma = 1 exactly is the identity (the default), 0^gamma = 0 for gamma > 0.
MRTPO_HD float relevance_power(float d, float gamma) {
  const float r = d > 0.f ? d : 0.f;
  if (gamma == 1.f) return r;
  return r > 0.f ? fast_exp(gamma * fast_log(r)) : 0.f;
}

// The allocation weight of one token: 1 where the reward is not reallocated (scale = 0),
// else (1 - alpha) + alpha w_hat with w_hat = g / scale, clipped and renormalized if asked.
MRTPO_HD float allocation_weight(float d, float scale, float renorm,
                                 const ReallocateParams& prm) {
  if (!(scale > 0.f)) return 1.f;
  float w_hat = relevance_power(d, prm.gamma) / scale;
  if (prm.clip) w_hat = fminf(fmaxf(w_hat, prm.clip_min), prm.clip_max) / renorm;
  return (1.f - prm.alpha) + prm.alpha * w_hat;
}

template <int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    reallocate_kernel(const float* __restrict__ per_reward, const float* __restrict__ lam,
                      const uint8_t* __restrict__ has_info, const float* __restrict__ relevance,
                      const int64_t* __restrict__ cu_seqlens,
                      const float* __restrict__ sequence, const float* __restrict__ divisor,
                      int64_t n_resp, int64_t n_rewards, int64_t n_tokens, ReallocateParams prm,
                      float* __restrict__ token, float* __restrict__ allocation) {
  // scale[k]: the divisor max(mean_k, delta) where reward k is reallocated, 0 where uniform;
  // renorm[k]: the mean of the clipped weights (1 without the clip).
  extern __shared__ float shared[];
  float* scale = shared;
  float* renorm = shared + n_rewards;
  __shared__ float scratch[BLOCK / kWarpSize];
  const float div = *divisor;
  const bool moves = div > 0.f;
  for (int64_t i = blockIdx.x; i < n_resp; i += gridDim.x) {
    const int64_t begin = cu_seqlens[i];
    const int64_t end = cu_seqlens[i + 1];
    const float len = static_cast<float>(end - begin > 1 ? end - begin : 1);
    const float seq = sequence[i];
    for (int64_t k = 0; k < n_rewards; ++k) {
      const float* d = relevance + k * n_tokens;
      float sum = 0.f;
      for (int64_t t = begin + threadIdx.x; t < end; t += BLOCK) {
        sum += relevance_power(d[t], prm.gamma);
      }
      sum = block_allreduce<BLOCK>(sum, SumMerge(), scratch);
      const float m = sum / len;
      const bool use = has_info[i * n_rewards + k] != 0 && m >= prm.delta;
      const float div = m > prm.delta ? m : prm.delta;
      float rn = 1.f;
      if (use && prm.clip) {
        float csum = 0.f;
        for (int64_t t = begin + threadIdx.x; t < end; t += BLOCK) {
          const float w = relevance_power(d[t], prm.gamma) / div;
          csum += fminf(fmaxf(w, prm.clip_min), prm.clip_max);
        }
        csum = block_allreduce<BLOCK>(csum, SumMerge(), scratch);
        rn = fmaxf(csum / len, 1e-30f);
      }
      if (threadIdx.x == 0) {
        scale[k] = use ? div : 0.f;
        renorm[k] = rn;
      }
    }
    __syncthreads();
    for (int64_t t = begin + threadIdx.x; t < end; t += BLOCK) {
      float moved = 0.f;
      for (int64_t k = 0; k < n_rewards; ++k) {
        const float w = allocation_weight(relevance[k * n_tokens + t], scale[k], renorm[k], prm);
        allocation[k * n_tokens + t] = w;
        const float c = per_reward[i * n_rewards + k] * lam[k];
        if (c != 0.f) moved += c * (w - 1.f);
      }
      token[t] = moves ? seq + moved / div : seq;
    }
    __syncthreads();  // scale / renorm are rewritten for the next response
  }
}

}  // namespace cuda
}  // namespace mrtpo
