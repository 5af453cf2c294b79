// Launcher of the reallocation kernel (advantages.cuh). Torch-free.
#include <cmath>

#include "grid.cuh"
#include "launchers.h"
#include "advantages.cuh"

// Qualified definition: the compiler checks it against the declaration in launchers.h.
cudaError_t mrtpo::cuda::launch_token_advantages(
    const float* per_reward, const float* lam, const uint8_t* has_info, const float* relevance,
    const int64_t* cu_seqlens, const float* sequence, const float* divisor, int64_t n_resp,
    int64_t n_rewards, int64_t n_tokens, float alpha, float gamma, float delta, float clip_min,
    float clip_max, float* token, float* allocation, cudaStream_t stream) {
  if (n_resp <= 0 || n_tokens <= 0) return cudaSuccess;
  const ReallocateParams prm{alpha, gamma, delta, clip_min, clip_max,
                             clip_min > 0.f || std::isfinite(clip_max)};
  constexpr int kBlock = kReallocateBlock;
  const size_t smem = 2 * static_cast<size_t>(n_rewards) * sizeof(float);
  reallocate_kernel<kBlock><<<rows_grid(n_resp), kBlock, smem, stream>>>(
      per_reward, lam, has_info, relevance, cu_seqlens, sequence, divisor, n_resp, n_rewards,
      n_tokens, prm, token, allocation);
  return cudaGetLastError();
}
