// Python bindings of mrtpo_kernels._cuda: tensor checks, output allocation, the current
// stream and device, then the torch-free launchers of launchers.h. The Python side
// (mrtpo_kernels/backends/cuda_backend.py) has already validated user input; the checks here
// guard the contract between the two (device, dtype, contiguity, shapes).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <tuple>

#include "launchers.h"

namespace {

using mrtpo::cuda::DType;

DType logits_dtype(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return DType::kFloat32;
    case torch::kBFloat16:
      return DType::kBFloat16;
    case torch::kFloat16:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, name, ": expected float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return DType::kFloat32;  // unreachable
}

void check_cuda(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void check_vec(const torch::Tensor& t, const char* name, int64_t n, torch::ScalarType dtype) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, ": expected shape (", n, "), got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected ", dtype, ", got ", t.scalar_type());
}

void check_same_device(const torch::Tensor& a, const torch::Tensor& b, const char* name) {
  TORCH_CHECK(a.device() == b.device(), name, ": expected device ", a.device(), ", got ",
              b.device());
}

// Optional (N,) fp32 input given as a tensor with 0 elements when absent.
const float* optional_vec(const torch::Tensor& t, const torch::Tensor& ref, const char* name,
                          int64_t n) {
  if (t.numel() == 0) return nullptr;
  check_vec(t, name, n, torch::kFloat32);
  check_same_device(ref, t, name);
  return t.data_ptr<float>();
}

// (logp, entropy or (0,), lse) for logits (N, V).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> logprobs_from_logits_fwd(
    const torch::Tensor& logits, const torch::Tensor& labels, double temperature,
    int64_t ignore_index, bool with_entropy) {
  check_cuda(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits: expected (N, V), got ", logits.sizes());
  const DType dtype = logits_dtype(logits, "logits");
  const int64_t n = logits.size(0);
  const int64_t v = logits.size(1);
  check_vec(labels, "labels", n, torch::kInt64);
  check_same_device(logits, labels, "labels");
  TORCH_CHECK(temperature > 0.0, "temperature: expected > 0, got ", temperature);

  const c10::cuda::CUDAGuard guard(logits.device());
  const auto f32 = logits.options().dtype(torch::kFloat32);
  torch::Tensor logp = torch::empty({n}, f32);
  torch::Tensor entropy = torch::empty({with_entropy ? n : 0}, f32);
  torch::Tensor lse = torch::empty({n}, f32);
  C10_CUDA_CHECK(mrtpo::cuda::launch_logprobs_fwd(
      dtype, logits.data_ptr(), labels.data_ptr<int64_t>(), n, v,
      static_cast<float>(1.0 / temperature), ignore_index, logp.data_ptr<float>(),
      with_entropy ? entropy.data_ptr<float>() : nullptr, lse.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream()));
  return {logp, entropy, lse};
}

// dL/dlogits (N, V) in the logits' dtype.
torch::Tensor logprobs_from_logits_bwd(const torch::Tensor& logits, const torch::Tensor& labels,
                                  const torch::Tensor& lse, const torch::Tensor& entropy,
                                  const torch::Tensor& grad_logp,
                                  const torch::Tensor& grad_entropy, double temperature,
                                  int64_t ignore_index) {
  check_cuda(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits: expected (N, V), got ", logits.sizes());
  const DType dtype = logits_dtype(logits, "logits");
  const int64_t n = logits.size(0);
  const int64_t v = logits.size(1);
  check_vec(labels, "labels", n, torch::kInt64);
  check_vec(lse, "lse", n, torch::kFloat32);
  check_vec(grad_logp, "grad_logp", n, torch::kFloat32);
  check_same_device(logits, labels, "labels");
  check_same_device(logits, lse, "lse");
  check_same_device(logits, grad_logp, "grad_logp");
  TORCH_CHECK(temperature > 0.0, "temperature: expected > 0, got ", temperature);
  const float* ent = optional_vec(entropy, logits, "entropy", n);
  const float* g_ent = optional_vec(grad_entropy, logits, "grad_entropy", n);
  TORCH_CHECK((ent == nullptr) == (g_ent == nullptr),
              "entropy / grad_entropy: give both or neither");

  const c10::cuda::CUDAGuard guard(logits.device());
  torch::Tensor grad = torch::empty_like(logits);
  C10_CUDA_CHECK(mrtpo::cuda::launch_logprobs_bwd(
      dtype, logits.data_ptr(), labels.data_ptr<int64_t>(), lse.data_ptr<float>(), ent,
      grad_logp.data_ptr<float>(), g_ent, n, v, static_cast<float>(1.0 / temperature),
      ignore_index, grad.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return grad;
}

// (K, N) JS distances between logits_p (N, V) and each row block of logits_q (K, N, V).
torch::Tensor js_distance(const torch::Tensor& logits_p, const torch::Tensor& logits_q,
                        double temperature) {
  check_cuda(logits_p, "logits_p");
  check_cuda(logits_q, "logits_q");
  TORCH_CHECK(logits_p.dim() == 2, "logits_p: expected (N, V), got ", logits_p.sizes());
  TORCH_CHECK(logits_q.dim() == 3 && logits_q.size(1) == logits_p.size(0) &&
                  logits_q.size(2) == logits_p.size(1),
              "logits_q: expected (K, ", logits_p.size(0), ", ", logits_p.size(1), "), got ",
              logits_q.sizes());
  TORCH_CHECK(logits_q.scalar_type() == logits_p.scalar_type(), "logits_q: expected ",
              logits_p.scalar_type(), " like logits_p, got ", logits_q.scalar_type());
  check_same_device(logits_p, logits_q, "logits_q");
  TORCH_CHECK(temperature > 0.0, "temperature: expected > 0, got ", temperature);
  const DType dtype = logits_dtype(logits_p, "logits_p");
  const int64_t n = logits_p.size(0);
  const int64_t v = logits_p.size(1);
  const int64_t k = logits_q.size(0);

  const c10::cuda::CUDAGuard guard(logits_p.device());
  torch::Tensor out = torch::empty({k, n}, logits_p.options().dtype(torch::kFloat32));
  C10_CUDA_CHECK(mrtpo::cuda::launch_js_distance(
      dtype, logits_p.data_ptr(), logits_q.data_ptr(), n, k, v,
      static_cast<float>(1.0 / temperature), out.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream()));
  return out;
}

// (token (N,), allocation (K, N)); every float input fp32.
std::tuple<torch::Tensor, torch::Tensor> mrtpo_token_advantages(
    const torch::Tensor& per_reward, const torch::Tensor& lam, const torch::Tensor& has_info,
    const torch::Tensor& relevance, const torch::Tensor& cu_seqlens, const torch::Tensor& sequence,
    const torch::Tensor& divisor, double alpha, double gamma, double delta, double clip_min,
    double clip_max) {
  check_cuda(relevance, "relevance");
  TORCH_CHECK(relevance.dim() == 2 && relevance.scalar_type() == torch::kFloat32,
              "relevance: expected (K, N) float32, got ", relevance.sizes(), " ",
              relevance.scalar_type());
  const int64_t k = relevance.size(0);
  const int64_t n_tok = relevance.size(1);
  check_cuda(per_reward, "per_reward");
  TORCH_CHECK(per_reward.dim() == 2 && per_reward.size(1) == k &&
                  per_reward.scalar_type() == torch::kFloat32,
              "per_reward: expected (n, ", k, ") float32, got ", per_reward.sizes(), " ",
              per_reward.scalar_type());
  const int64_t n = per_reward.size(0);
  check_vec(lam, "lam", k, torch::kFloat32);
  check_cuda(has_info, "has_info");
  TORCH_CHECK(has_info.dim() == 2 && has_info.size(0) == n && has_info.size(1) == k &&
                  (has_info.scalar_type() == torch::kBool ||
                   has_info.scalar_type() == torch::kUInt8),
              "has_info: expected (", n, ", ", k, ") bool, got ", has_info.sizes(), " ",
              has_info.scalar_type());
  check_vec(cu_seqlens, "cu_seqlens", n + 1, torch::kInt64);
  check_vec(sequence, "sequence", n, torch::kFloat32);
  check_cuda(divisor, "divisor");
  TORCH_CHECK(divisor.numel() == 1 && divisor.scalar_type() == torch::kFloat32,
              "divisor: expected one float32 value");
  for (const auto* t : {&per_reward, &lam, &has_info, &cu_seqlens, &sequence, &divisor}) {
    check_same_device(relevance, *t, "per_reward/lam/has_info/cu_seqlens/sequence/divisor");
  }

  const c10::cuda::CUDAGuard guard(relevance.device());
  torch::Tensor token = torch::empty({n_tok}, relevance.options());
  torch::Tensor alloc = torch::empty({k, n_tok}, relevance.options());
  const float clip_hi = std::isfinite(clip_max) ? static_cast<float>(clip_max) : INFINITY;
  C10_CUDA_CHECK(mrtpo::cuda::launch_token_advantages(
      per_reward.data_ptr<float>(), lam.data_ptr<float>(),
      static_cast<const uint8_t*>(has_info.data_ptr()), relevance.data_ptr<float>(),
      cu_seqlens.data_ptr<int64_t>(), sequence.data_ptr<float>(), divisor.data_ptr<float>(), n, k,
      n_tok, static_cast<float>(alpha), static_cast<float>(gamma), static_cast<float>(delta),
      static_cast<float>(clip_min), clip_hi, token.data_ptr<float>(), alloc.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream()));
  return {token, alloc};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mrtpo CUDA kernels for the memory-bound stages (logits ops, reallocation)";
  m.def("logprobs_from_logits_fwd", &logprobs_from_logits_fwd,
        "log-probs, entropy, lse from logits", py::arg("logits"), py::arg("labels"),
        py::arg("temperature"), py::arg("ignore_index"), py::arg("with_entropy"));
  m.def("logprobs_from_logits_bwd", &logprobs_from_logits_bwd,
        "dL/dlogits of log-probs and entropy", py::arg("logits"), py::arg("labels"),
        py::arg("lse"), py::arg("entropy"), py::arg("grad_logp"), py::arg("grad_entropy"),
        py::arg("temperature"), py::arg("ignore_index"));
  m.def("js_distance", &js_distance, "per-token JS distance, one P against K Q streams",
        py::arg("logits_p"), py::arg("logits_q"), py::arg("temperature"));
  m.def("mrtpo_token_advantages", &mrtpo_token_advantages,
        "MRTPO token advantages over packed responses", py::arg("per_reward"), py::arg("lam"),
        py::arg("has_info"), py::arg("relevance"), py::arg("cu_seqlens"), py::arg("sequence"),
        py::arg("divisor"), py::arg("alpha"), py::arg("gamma"), py::arg("delta"),
        py::arg("clip_min"), py::arg("clip_max"));
}
