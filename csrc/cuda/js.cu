// Launcher of the JS-distance kernel (js.cuh): dtype and stream-group dispatch. Torch-free.
#include "grid.cuh"
#include "js.cuh"
#include "launchers.h"

namespace mrtpo {
namespace cuda {
namespace {

template <typename T>
cudaError_t js_distance_typed(const void* logits_p, const void* logits_q, int64_t n_rows,
                              int64_t n_streams, int64_t vocab, float inv_temp, float* out,
                              cudaStream_t stream) {
  constexpr int kBlock = kJsBlock;
  const T* p = static_cast<const T*>(logits_p);
  const T* q = static_cast<const T*>(logits_q);
  const unsigned grid = rows_grid(n_rows);
  // K = 1 (the common case) gets its own instantiation with half the per-thread state; any
  // other K runs in groups of 4 streams that share one read of P per pass.
  if (n_streams == 1) {
    js_kernel<T, kBlock, 1><<<grid, kBlock, 0, stream>>>(p, q, n_rows, n_streams, vocab,
                                                         inv_temp, out);
  } else {
    js_kernel<T, kBlock, 4><<<grid, kBlock, 0, stream>>>(p, q, n_rows, n_streams, vocab,
                                                         inv_temp, out);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace cuda
}  // namespace mrtpo

// Qualified definitions: the compiler checks them against the declarations in launchers.h.
cudaError_t mrtpo::cuda::launch_js_distance(
    DType dtype, const void* logits_p, const void* logits_q, int64_t n_rows, int64_t n_streams,
    int64_t vocab, float inv_temp, float* out, cudaStream_t stream) {
  if (n_rows <= 0 || n_streams <= 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return js_distance_typed<float>(logits_p, logits_q, n_rows, n_streams, vocab, inv_temp,
                                      out, stream);
    case DType::kBFloat16:
      return js_distance_typed<__nv_bfloat16>(logits_p, logits_q, n_rows, n_streams, vocab,
                                              inv_temp, out, stream);
    case DType::kFloat16:
      return js_distance_typed<__half>(logits_p, logits_q, n_rows, n_streams, vocab, inv_temp,
                                       out, stream);
  }
  return cudaErrorInvalidValue;
}
