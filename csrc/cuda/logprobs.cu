// Launchers of the log-prob kernels (logprobs.cuh): dtype dispatch, grid, launch status.
// Torch-free.
#include "grid.cuh"
#include "launchers.h"
#include "logprobs.cuh"

namespace mrtpo {
namespace cuda {
namespace {

template <typename T>
cudaError_t logprobs_fwd_typed(const void* logits, const int64_t* labels, int64_t n_rows,
                               int64_t vocab, float inv_temp, int64_t ignore_index, float* logp,
                               float* entropy, float* lse, cudaStream_t stream) {
  constexpr int kBlock = kLogprobsBlock;
  const T* z = static_cast<const T*>(logits);
  const unsigned grid = rows_grid(n_rows);
  if (entropy != nullptr) {
    logprobs_fwd_kernel<T, kBlock, true><<<grid, kBlock, 0, stream>>>(
        z, labels, n_rows, vocab, inv_temp, ignore_index, logp, entropy, lse);
  } else {
    logprobs_fwd_kernel<T, kBlock, false><<<grid, kBlock, 0, stream>>>(
        z, labels, n_rows, vocab, inv_temp, ignore_index, logp, nullptr, lse);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t logprobs_bwd_typed(const void* logits, const int64_t* labels, const float* lse,
                               const float* entropy, const float* grad_logp,
                               const float* grad_entropy, int64_t n_rows, int64_t vocab,
                               float inv_temp, int64_t ignore_index, void* grad_logits,
                               cudaStream_t stream) {
  constexpr int kBlock = kLogprobsBlock;
  (void)lse;  // not read: the kernel recomputes each row's raw max and sum (logprobs.cuh)
  const T* z = static_cast<const T*>(logits);
  T* dz = static_cast<T*>(grad_logits);
  const unsigned grid = rows_grid(n_rows);
  if (entropy != nullptr && grad_entropy != nullptr) {
    logprobs_bwd_kernel<T, kBlock, true><<<grid, kBlock, 0, stream>>>(
        z, labels, entropy, grad_logp, grad_entropy, n_rows, vocab, inv_temp, ignore_index, dz);
  } else {
    logprobs_bwd_kernel<T, kBlock, false><<<grid, kBlock, 0, stream>>>(
        z, labels, nullptr, grad_logp, nullptr, n_rows, vocab, inv_temp, ignore_index, dz);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace cuda
}  // namespace mrtpo

// Qualified definitions: the compiler checks them against the declarations in launchers.h.
cudaError_t mrtpo::cuda::launch_logprobs_fwd(
    DType dtype, const void* logits, const int64_t* labels, int64_t n_rows, int64_t vocab,
    float inv_temp, int64_t ignore_index, float* logp, float* entropy, float* lse,
    cudaStream_t stream) {
  if (n_rows <= 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return logprobs_fwd_typed<float>(logits, labels, n_rows, vocab, inv_temp, ignore_index,
                                       logp, entropy, lse, stream);
    case DType::kBFloat16:
      return logprobs_fwd_typed<__nv_bfloat16>(logits, labels, n_rows, vocab, inv_temp,
                                               ignore_index, logp, entropy, lse, stream);
    case DType::kFloat16:
      return logprobs_fwd_typed<__half>(logits, labels, n_rows, vocab, inv_temp, ignore_index,
                                        logp, entropy, lse, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t mrtpo::cuda::launch_logprobs_bwd(
    DType dtype, const void* logits, const int64_t* labels, const float* lse, const float* entropy,
    const float* grad_logp, const float* grad_entropy, int64_t n_rows, int64_t vocab,
    float inv_temp, int64_t ignore_index, void* grad_logits, cudaStream_t stream) {
  if (n_rows <= 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return logprobs_bwd_typed<float>(logits, labels, lse, entropy, grad_logp, grad_entropy,
                                       n_rows, vocab, inv_temp, ignore_index, grad_logits,
                                       stream);
    case DType::kBFloat16:
      return logprobs_bwd_typed<__nv_bfloat16>(logits, labels, lse, entropy, grad_logp,
                                               grad_entropy, n_rows, vocab, inv_temp,
                                               ignore_index, grad_logits, stream);
    case DType::kFloat16:
      return logprobs_bwd_typed<__half>(logits, labels, lse, entropy, grad_logp, grad_entropy,
                                        n_rows, vocab, inv_temp, ignore_index, grad_logits,
                                        stream);
  }
  return cudaErrorInvalidValue;
}
