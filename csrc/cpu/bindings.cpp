// Python bindings of the CPU chunk kernels: tensor checks, OpenMP split over rows
// (at::parallel_for), dispatch on fp32 (ISA-cloned kernels) / fp64 (for gradcheck).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <optional>
#include <tuple>

#include "chunk_kernels.h"

namespace {

using at::Tensor;

void check_chunk(const Tensor& z, const char* name) {
  TORCH_CHECK(z.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(z.dim() == 2, name, ": expected a 2-D [rows, V] chunk, got ", z.dim(), "-D");
  TORCH_CHECK(z.is_contiguous(), name, ": expected a contiguous chunk");
  TORCH_CHECK(z.scalar_type() == at::kFloat || z.scalar_type() == at::kDouble, name,
              ": expected float32 or float64, got ", z.scalar_type());
}

void check_rows(const Tensor& t, const Tensor& z, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == z.size(0), name, ": expected shape [", z.size(0),
              "], got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void check_labels(const Tensor& labels, const Tensor& z) {
  check_rows(labels, z, "labels");
  TORCH_CHECK(labels.scalar_type() == at::kLong, "labels: expected int64");
}

// The logit transform's slope for the gradient kernels (row_kernels.h): the scale a and
// 1 / s (0: no softcap; softcap <= 0 means none).
template <typename T>
mrtpo::LogitCap<T> logit_cap(double logit_scale, double softcap) {
  mrtpo::LogitCap<T> cap;
  cap.scale = static_cast<T>(logit_scale);
  cap.inv_cap = softcap > 0 ? static_cast<T>(1.0 / softcap) : T(0);
  return cap;
}

template <typename T>
const T* opt_ptr(const std::optional<Tensor>& t) {
  return t.has_value() && t->numel() > 0 ? t->data_ptr<T>() : nullptr;
}

// Rows are long (V ~ 150k): give each thread whole rows.
constexpr int64_t kGrain = 1;

// After a pass: the kernels never index with a label outside [0, V) (they give that row a
// NaN log-prob and a zero gradient), and here the caller gets a ValueError naming labels.
void raise_bad_labels(int64_t bad, int64_t V, int64_t ignore_index) {
  TORCH_CHECK_VALUE(bad == 0, "labels: ", bad, " label(s) outside [0, ", V,
                    ") that are not ignore_index=", ignore_index,
                    " (found by the kernel: value checks were off)");
}

std::tuple<Tensor, Tensor, Tensor> stats(const Tensor& z, const Tensor& labels, double inv_t,
                                         int64_t ignore_index, bool with_ent) {
  check_chunk(z, "z");
  check_labels(labels, z);
  const int64_t C = z.size(0), V = z.size(1);
  Tensor logp = at::empty({C}, z.options());
  Tensor ent = at::empty({with_ent ? C : 0}, z.options());
  Tensor lse = at::empty({C}, z.options());
  const int64_t* lab = labels.data_ptr<int64_t>();
  std::atomic<int64_t> bad{0};
  if (z.scalar_type() == at::kFloat) {
    const float* zp = z.data_ptr<float>();
    float *lp = logp.data_ptr<float>(), *en = ent.data_ptr<float>(), *ls = lse.data_ptr<float>();
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      bad += mrtpo::stats_rows_f32(zp, V, static_cast<float>(inv_t), lab, ignore_index, with_ent,
                                   lp, en, ls, b, e);
    });
  } else {
    const double* zp = z.data_ptr<double>();
    double *lp = logp.data_ptr<double>(), *en = ent.data_ptr<double>(),
           *ls = lse.data_ptr<double>();
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      bad += mrtpo::stats_rows<double>(zp, V, inv_t, lab, ignore_index, with_ent, lp, en, ls, b, e);
    });
  }
  raise_bad_labels(bad.load(), V, ignore_index);
  return {logp, ent, lse};
}

void grad_(Tensor& z, const Tensor& labels, const Tensor& lse, const std::optional<Tensor>& ent,
           const Tensor& g_lp, const std::optional<Tensor>& g_ent, double inv_t,
           int64_t ignore_index, double logit_scale, double softcap) {
  check_chunk(z, "z");
  check_labels(labels, z);
  check_rows(lse, z, "lse");
  check_rows(g_lp, z, "grad_logp");
  const bool use_ent = ent.has_value() && g_ent.has_value() && ent->numel() && g_ent->numel();
  if (use_ent) {
    check_rows(*ent, z, "entropy");
    check_rows(*g_ent, z, "grad_entropy");
  }
  const int64_t C = z.size(0), V = z.size(1);
  const int64_t* lab = labels.data_ptr<int64_t>();
  // lse is not read: the kernel recomputes each row's max and sum (see row_kernels.h)
  std::atomic<int64_t> bad{0};
  if (z.scalar_type() == at::kFloat) {
    float* zp = z.data_ptr<float>();
    const float* en = use_ent ? ent->data_ptr<float>() : nullptr;
    const float* ge = use_ent ? g_ent->data_ptr<float>() : nullptr;
    const auto cap = logit_cap<float>(logit_scale, softcap);
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      bad += mrtpo::grad_rows_f32(zp, V, static_cast<float>(inv_t), lab, ignore_index, en,
                                  g_lp.data_ptr<float>(), ge, b, e, cap);
    });
  } else {
    double* zp = z.data_ptr<double>();
    const double* en = use_ent ? ent->data_ptr<double>() : nullptr;
    const double* ge = use_ent ? g_ent->data_ptr<double>() : nullptr;
    const auto cap = logit_cap<double>(logit_scale, softcap);
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      bad += mrtpo::grad_rows<double>(zp, V, inv_t, lab, ignore_index, en,
                                      g_lp.data_ptr<double>(), ge, b, e, cap);
    });
  }
  raise_bad_labels(bad.load(), V, ignore_index);
}

// lse_p: opaque per-row statistics of zp ([rows, 2]: raw max, log s), returned by a first
// call and passed back for the next q against the same p.
std::tuple<Tensor, Tensor> js(const Tensor& zp, const Tensor& zq, double inv_t,
                              const std::optional<Tensor>& lse_p_in) {
  check_chunk(zp, "zp");
  check_chunk(zq, "zq");
  TORCH_CHECK(zp.sizes() == zq.sizes(), "zq: expected the shape of zp ", zp.sizes(), ", got ",
              zq.sizes());
  TORCH_CHECK(zp.scalar_type() == zq.scalar_type(), "zq: expected the dtype of zp");
  const int64_t C = zp.size(0), V = zp.size(1);
  const bool have = lse_p_in.has_value() && lse_p_in->numel() > 0;
  Tensor lse_p = have ? *lse_p_in : at::empty({C, 2}, zp.options());
  if (have) {
    TORCH_CHECK(lse_p.dim() == 2 && lse_p.size(0) == C && lse_p.size(1) == 2 &&
                    lse_p.is_contiguous() && lse_p.scalar_type() == zp.scalar_type(),
                "lse_p: expected the [rows, 2] statistics returned by js for this zp");
  }
  Tensor out = at::empty({C}, zp.options());
  if (zp.scalar_type() == at::kFloat) {
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      mrtpo::js_rows_f32(zp.data_ptr<float>(), zq.data_ptr<float>(), V, static_cast<float>(inv_t),
                         lse_p.data_ptr<float>(), have, out.data_ptr<float>(), b, e);
    });
  } else {
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      mrtpo::js_rows<double>(zp.data_ptr<double>(), zq.data_ptr<double>(), V, inv_t,
                             lse_p.data_ptr<double>(), have, out.data_ptr<double>(), b, e);
    });
  }
  return {out, lse_p};
}

// z: [1 + K, C, V] stacked logits (P first, then the K Q streams of the same C tokens),
// as one GEMM wrote them; returns the [K, C] distances of each Q_j to P.
Tensor js_many(const Tensor& z, double inv_t) {
  TORCH_CHECK(z.device().is_cpu(), "z: expected a CPU tensor");
  TORCH_CHECK(z.dim() == 3 && z.size(0) >= 2, "z: expected [1 + K, rows, V] with K >= 1, got ",
              z.sizes());
  TORCH_CHECK(z.is_contiguous(), "z: expected a contiguous tensor");
  TORCH_CHECK(z.scalar_type() == at::kFloat || z.scalar_type() == at::kDouble,
              "z: expected float32 or float64, got ", z.scalar_type());
  const int64_t S = z.size(0), C = z.size(1), V = z.size(2);
  Tensor out = at::empty({S - 1, C}, z.options());
  if (z.scalar_type() == at::kFloat) {
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      mrtpo::js_many_rows_f32(z.data_ptr<float>(), S, C, V, static_cast<float>(inv_t),
                              out.data_ptr<float>(), b, e);
    });
  } else {
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      mrtpo::js_many_rows<double>(z.data_ptr<double>(), S, C, V, inv_t, out.data_ptr<double>(),
                                  b, e);
    });
  }
  return out;
}

std::tuple<Tensor, Tensor, Tensor> policy_(Tensor& z, const Tensor& labels, const Tensor& old_lp,
                                           const Tensor& adv, const Tensor& weight,
                                           const std::optional<Tensor>& ref_lp, double inv_t,
                                           double clip_low, double clip_high, double beta,
                                           int64_t ignore_index, bool need_grad,
                                           double clip_ratio_c, bool kl_iw, double logit_scale,
                                           double softcap) {
  check_chunk(z, "z");
  check_labels(labels, z);
  check_rows(old_lp, z, "old_logprobs");
  check_rows(adv, z, "advantages");
  check_rows(weight, z, "token_weight");
  const bool has_ref = ref_lp.has_value() && ref_lp->numel() > 0;
  if (has_ref) check_rows(*ref_lp, z, "ref_logprobs");
  const int64_t C = z.size(0), V = z.size(1);
  Tensor loss = at::empty({C}, z.options());
  Tensor logp = at::empty({C}, z.options());
  Tensor clipped = at::empty({C}, z.options());
  const int64_t* lab = labels.data_ptr<int64_t>();
  std::atomic<int64_t> bad{0};
  if (z.scalar_type() == at::kFloat) {
    const auto cap = logit_cap<float>(logit_scale, softcap);
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      bad += mrtpo::policy_rows_f32(z.data_ptr<float>(), V, static_cast<float>(inv_t), lab, ignore_index,
                             old_lp.data_ptr<float>(), adv.data_ptr<float>(),
                             weight.data_ptr<float>(), opt_ptr<float>(ref_lp),
                             static_cast<float>(clip_low), static_cast<float>(clip_high),
                             static_cast<float>(beta), static_cast<float>(clip_ratio_c), kl_iw,
                             need_grad, loss.data_ptr<float>(),
                             logp.data_ptr<float>(), clipped.data_ptr<float>(), b, e, cap);
    });
  } else {
    const auto cap = logit_cap<double>(logit_scale, softcap);
    at::parallel_for(0, C, kGrain, [&](int64_t b, int64_t e) {
      bad += mrtpo::policy_rows<double>(z.data_ptr<double>(), V, inv_t, lab, ignore_index,
                                 old_lp.data_ptr<double>(), adv.data_ptr<double>(),
                                 weight.data_ptr<double>(), opt_ptr<double>(ref_lp), clip_low,
                                 clip_high, beta, clip_ratio_c, kl_iw, need_grad,
                                 loss.data_ptr<double>(),
                                 logp.data_ptr<double>(), clipped.data_ptr<double>(), b, e,
                                 cap);
    });
  }
  raise_bad_labels(bad.load(), V, ignore_index);
  return {loss, logp, clipped};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mrtpo-kernels CPU chunk kernels (streaming reductions over fp32 logits chunks)";
  m.def("stats", &stats, "log-normalizer, label log-prob and entropy of each row", py::arg("z"),
        py::arg("labels"), py::arg("inv_t"), py::arg("ignore_index"), py::arg("with_ent"));
  m.def("grad_", &grad_, "overwrite each row of logits with dL/dlogits", py::arg("z"),
        py::arg("labels"), py::arg("lse"), py::arg("ent"), py::arg("g_lp"), py::arg("g_ent"),
        py::arg("inv_t"), py::arg("ignore_index"), py::arg("logit_scale") = 1.0,
        py::arg("softcap") = 0.0);
  m.def("js", &js, "JS distance between rows of zp and zq", py::arg("zp"), py::arg("zq"),
        py::arg("inv_t"), py::arg("lse_p"));
  m.def("js_many", &js_many, "JS distance of each stacked Q stream's rows to P's (stream 0)",
        py::arg("z"), py::arg("inv_t"));
  m.def("policy_", &policy_, "clipped surrogate per row; dL/dlogits in place", py::arg("z"),
        py::arg("labels"), py::arg("old_lp"), py::arg("adv"), py::arg("weight"),
        py::arg("ref_lp"), py::arg("inv_t"), py::arg("clip_low"), py::arg("clip_high"),
        py::arg("beta"), py::arg("ignore_index"), py::arg("need_grad"),
        py::arg("clip_ratio_c") = std::numeric_limits<double>::infinity(),
        py::arg("kl_iw") = false, py::arg("logit_scale") = 1.0, py::arg("softcap") = 0.0);
}
