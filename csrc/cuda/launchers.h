// Host entry points of the mrtpo CUDA kernels: plain C++ over raw device pointers and a
// stream, no torch. bindings.cpp checks tensors and calls these; the launchers (*.cu) pick
// the kernel instantiation for the dtype and return the launch status (no synchronization).
//
// All pointers are device pointers to contiguous row-major data; shapes in the comments of
// logprobs.cuh, js.cuh and advantages.cuh. Optional outputs / inputs may be nullptr where
// noted. Zero rows (or responses) launch nothing and return cudaSuccess.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mrtpo {
namespace cuda {

// Element type of the logits.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// logp, entropy, lse (N,) fp32 from logits (N, V); entropy == nullptr: not computed.
cudaError_t launch_logprobs_fwd(DType dtype, const void* logits, const int64_t* labels,
                                int64_t n_rows, int64_t vocab, float inv_temp,
                                int64_t ignore_index, float* logp, float* entropy, float* lse,
                                cudaStream_t stream);

// grad_logits (N, V) in dtype; entropy and grad_entropy both nullptr: no entropy term. lse
// is part of the interface but not read: each row's raw max and sum are recomputed.
cudaError_t launch_logprobs_bwd(DType dtype, const void* logits, const int64_t* labels,
                                const float* lse, const float* entropy, const float* grad_logp,
                                const float* grad_entropy, int64_t n_rows, int64_t vocab,
                                float inv_temp, int64_t ignore_index, void* grad_logits,
                                cudaStream_t stream);

// out (K, N) fp32 JS distances between logits_p (N, V) and each of logits_q (K, N, V).
cudaError_t launch_js_distance(DType dtype, const void* logits_p, const void* logits_q,
                               int64_t n_rows, int64_t n_streams, int64_t vocab, float inv_temp,
                               float* out, cudaStream_t stream);

// token (N,) and allocation (K, N) from per_reward (n, K), lam (K,), has_info (n, K) bytes,
// relevance (K, N), cu_seqlens (n + 1,), sequence (n,) (GDPO's sequence advantages), divisor
// () (the redistribution's D); clip bounds 0 / inf: no clip. The outputs are final.
cudaError_t launch_token_advantages(const float* per_reward, const float* lam,
                                    const uint8_t* has_info, const float* relevance,
                                    const int64_t* cu_seqlens, const float* sequence,
                                    const float* divisor, int64_t n_resp, int64_t n_rewards,
                                    int64_t n_tokens, float alpha, float gamma, float delta,
                                    float clip_min, float clip_max, float* token,
                                    float* allocation, cudaStream_t stream);

}  // namespace cuda
}  // namespace mrtpo
