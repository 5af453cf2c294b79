// Compile-and-run harness for the torch-free CUDA headers (csrc/cuda/*.cuh), used by
// tests/test_cuda_build.py on machines without a GPU.
//
// 1. Instantiates every kernel template for float, __nv_bfloat16 and __half (taking each
//    kernel's address), so that nvcc -arch=sm_90 compiles all device code paths.
// 2. main() runs the host-device pieces of the kernels on the CPU, one simulated thread of
//    a CTA at a time, and merges the per-thread states the way block_allreduce does (xor
//    butterfly inside each warp, then the warps in order). It checks against float64
//    arithmetic written here:
//      - the row loops visit every element exactly once, for any length and misalignment;
//      - log-prob, entropy and lse, and the logit gradient, for odd vocabularies, extreme and
//        -inf logits;
//      - the JS distance: 0 for identical rows, 1 for disjoint supports, close rows and far
//        rows against float64, one-vs-K with K = 1 and 3;
//      - the reallocation weights.
//    It prints one line per failed check and exits with status 1 if any failed.
// The exp / log here are the C library's, not the GPU's MUFU approximations: what is checked is
// the algorithm (indexing, online statistics, merges, series), not the last ulp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "js.cuh"
#include "logprobs.cuh"
#include "advantages.cuh"

using namespace mrtpo::cuda;

// ------------------------------------------------------------------ 1. instantiations

template <typename T>
void instantiate_kernels() {
  const void* kernels[] = {
      reinterpret_cast<const void*>(&logprobs_fwd_kernel<T, kLogprobsBlock, true>),
      reinterpret_cast<const void*>(&logprobs_fwd_kernel<T, kLogprobsBlock, false>),
      reinterpret_cast<const void*>(&logprobs_bwd_kernel<T, kLogprobsBlock, true>),
      reinterpret_cast<const void*>(&logprobs_bwd_kernel<T, kLogprobsBlock, false>),
      reinterpret_cast<const void*>(&js_kernel<T, kJsBlock, 1>),
      reinterpret_cast<const void*>(&js_kernel<T, kJsBlock, 4>),
  };
  (void)kernels;
}

template void instantiate_kernels<float>();
template void instantiate_kernels<__nv_bfloat16>();
template void instantiate_kernels<__half>();

const void* reallocate_kernel_address() {
  return reinterpret_cast<const void*>(&reallocate_kernel<kReallocateBlock>);
}

// ------------------------------------------------------------------ 2. CPU checks

static int g_failures = 0;
static int g_checks = 0;

static void expect(bool ok, const char* what, const char* ctx, double got, double want) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::printf("FAIL %s [%s]: got %.9g, want %.9g\n", what, ctx, got, want);
  }
}

static bool close_to(double got, double want, double atol, double rtol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

template <typename T>
const char* type_name();
template <>
const char* type_name<float>() {
  return "fp32";
}
template <>
const char* type_name<__nv_bfloat16>() {
  return "bf16";
}
template <>
const char* type_name<__half>() {
  return "fp16";
}

// Merge per-thread states as block_allreduce does: xor butterfly inside each warp, then the
// warps' lane-0 values in order.
template <typename S, typename Merge>
S simulate_block_allreduce(std::vector<S> parts, Merge merge) {
  const int n = static_cast<int>(parts.size());
  for (int w0 = 0; w0 < n; w0 += kWarpSize) {
    for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) {
      std::vector<S> next(parts.begin() + w0, parts.begin() + w0 + kWarpSize);
      for (int l = 0; l < kWarpSize; ++l) next[l] = merge(parts[w0 + l], parts[w0 + (l ^ mask)]);
      for (int l = 0; l < kWarpSize; ++l) parts[w0 + l] = next[l];
    }
  }
  S y = parts[0];
  for (int w0 = kWarpSize; w0 < n; w0 += kWarpSize) y = merge(y, parts[w0]);
  return y;
}

// A buffer whose data starts `offset` elements after a 256-byte boundary, as a tensor with a
// storage offset would.
template <typename T>
struct Buffer {
  std::vector<uint8_t> bytes;
  T* data;
  Buffer(size_t n, size_t offset) : bytes((n + offset) * sizeof(T) + 512) {
    uintptr_t base = reinterpret_cast<uintptr_t>(bytes.data());
    base = (base + 255) & ~static_cast<uintptr_t>(255);
    data = reinterpret_cast<T*>(base) + offset;
  }
};

template <typename T>
std::vector<double> rounded(const T* x, size_t n) {
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(to_float(x[i]));
  return out;
}

// ---- row loops cover every element exactly once

template <typename T>
void check_row_coverage() {
  constexpr int B = kLogprobsBlock;
  const int64_t vocabs[] = {1, 2, 3, 7, 8, 9, 1000, 4099, 8192, 16391, 20011};
  for (int64_t vocab : vocabs) {
    for (size_t off = 0; off < 4; ++off) {
      Buffer<T> in(vocab, off);
      Buffer<T> out(vocab, off);
      Buffer<T> out_shifted(vocab, off + 1);
      for (int64_t v = 0; v < vocab; ++v) in.data[v] = from_float<T>(static_cast<float>(v % 251));
      std::vector<int> seen(vocab, 0);
      bool values_ok = true;
      for (int64_t tid = 0; tid < B; ++tid) {
        auto f = [&](int64_t v, float x) {
          if (v < 0 || v >= vocab) {
            values_ok = false;
            return;
          }
          ++seen[v];
          values_ok = values_ok && x == static_cast<float>(v % 251);
        };
        for_each_in_row<T, B, kLogprobsUnroll>(in.data, vocab, tid, f);
        auto g = [](int64_t v, float x) { return x + static_cast<float>(v % 3); };
        map_row<T, B, kLogprobsUnroll, true>(in.data, out.data, vocab, tid, g);
        map_row<T, B, kLogprobsUnroll, true>(in.data, out_shifted.data, vocab, tid, g);
      }
      int64_t bad = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        const float want = static_cast<float>(v % 251 + v % 3);
        bad += seen[v] != 1;
        bad += to_float(out.data[v]) != to_float(from_float<T>(want));
        bad += to_float(out_shifted.data[v]) != to_float(from_float<T>(want));
      }
      char ctx[96];
      std::snprintf(ctx, sizeof(ctx), "%s V=%lld offset=%zu", type_name<T>(),
                    static_cast<long long>(vocab), off);
      expect(bad == 0 && values_ok, "row loops: each element once, right value", ctx,
             static_cast<double>(bad), 0.0);
    }
  }
}

// ---- log-probs forward and backward

struct RowOut {
  float logp, entropy, lse;
};

// The backward's recompute of a row's (raw max, log sum), over simulated threads.
template <typename T>
LogNorm simulate_norm(const T* row, int64_t vocab, float inv_temp) {
  constexpr int B = kLogprobsBlock;
  std::vector<MaxSum> parts(B);
  for (int64_t tid = 0; tid < B; ++tid) {
    parts[tid] = logprobs_row_norm_partial<T, B>(row, vocab, inv_temp, tid);
  }
  return simulate_block_allreduce(parts, MaxSumMerge{2.f * inv_temp}).log_norm();
}

// The forward over simulated threads: (logp, entropy, lse) of one row.
template <typename T>
RowOut simulate_logprobs_row(const T* row, int64_t vocab, int64_t y, float inv_temp) {
  constexpr int B = kLogprobsBlock;
  std::vector<LseState> parts(B);
  for (int64_t tid = 0; tid < B; ++tid) {
    parts[tid] = logprobs_row_partial<T, B, true>(row, vocab, inv_temp, tid);
  }
  const LseState st = simulate_block_allreduce(parts, LseMerge{2.f * inv_temp});
  RowOut out{0.f, 0.f, 0.f};
  logprobs_row_finish<T, true>(st, row, vocab, y, inv_temp, &out.logp, &out.entropy, &out.lse);
  return out;
}

struct RowRef {
  double logp, entropy, lse;
};

RowRef logprobs_ref(const std::vector<double>& z, int64_t y, double tau) {
  double m = -INFINITY;
  for (double x : z) m = std::fmax(m, x / tau);
  double s = 0.0;
  for (double x : z) s += std::exp(x / tau - m);
  const double lse = m + std::log(s);
  double ent = 0.0;
  for (double x : z) {
    const double lp = x / tau - lse;
    if (std::exp(lp) > 0.0) ent -= std::exp(lp) * lp;
  }
  return RowRef{z[y] / tau - lse, ent, lse};
}

template <typename T>
void fill_row(T* row, int64_t vocab, int kind, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int64_t v = 0; v < vocab; ++v) {
    float x = normal(rng);
    if (kind == 1 && v % 5 == 1) x = -INFINITY;  // masked vocabulary entries
    if (kind == 2) x = (v % 2 == 0) ? 1e4f : -1e4f;  // extreme logits
    if (kind == 3) x = 0.5f;                          // all equal
    row[v] = from_float<T>(x);
  }
  if (kind == 1) row[0] = from_float<T>(1.f);  // keep one finite entry
}

template <typename T>
void check_logprobs() {
  constexpr int B = kLogprobsBlock;
  std::mt19937 rng(1234);
  const int64_t vocabs[] = {1, 2, 1000, 5003, 151936};
  const float tau = 0.7f;
  for (int64_t vocab : vocabs) {
    for (int kind = 0; kind < 4; ++kind) {
      const size_t off = (vocab + kind) % 3;
      Buffer<T> row(vocab, off);
      fill_row(row.data, vocab, kind, rng);
      const int64_t y = (vocab * 7 / 11) % vocab;
      const std::vector<double> z = rounded(row.data, vocab);
      const RowRef ref = logprobs_ref(z, y, tau);
      std::vector<LseState> parts(B);
      for (int64_t tid = 0; tid < B; ++tid) {
        parts[tid] = logprobs_row_partial<T, B, true>(row.data, vocab, 1.f / tau, tid);
      }
      const LseState st = simulate_block_allreduce(parts, LseMerge{2.f / tau});
      float logp = 0.f, ent = 0.f, lse = 0.f;
      logprobs_row_finish<T, true>(st, row.data, vocab, y, 1.f / tau, &logp, &ent, &lse);
      char ctx[96];
      std::snprintf(ctx, sizeof(ctx), "%s V=%lld kind=%d", type_name<T>(),
                    static_cast<long long>(vocab), kind);
      const double scale = std::fabs(ref.lse) + 1.0;
      expect(close_to(lse, ref.lse, 2e-6 * scale, 0.0), "lse", ctx, lse, ref.lse);
      // logp: fp32 rounding of z_y / tau (inherent) plus a few ulp of |logp|.
      const double logp_tol = 4e-6 * (std::fabs(ref.logp) + 1.0) + 2.4e-7 * std::fabs(z[y] / tau);
      expect(close_to(logp, ref.logp, logp_tol, 0.0), "logp", ctx, logp, ref.logp);
      expect(close_to(ent, ref.entropy, 2e-5 * (ref.entropy + 1.0), 0.0), "entropy", ctx, ent,
             ref.entropy);

      // Backward against float64, output rounded to T (the row's max and sum recomputed).
      const float g = 0.37f, gh = -1.3f;
      const LogNorm nz = simulate_norm<T>(row.data, vocab, 1.f / tau);
      Buffer<T> grad(vocab, off);
      for (int64_t tid = 0; tid < B; ++tid) {
        logprobs_bwd_row<T, B, true>(row.data, grad.data, vocab, y, false, nz, ent, g, gh,
                                     1.f / tau, tid);
      }
      double worst = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        const double lp = z[v] / tau - ref.lse;
        const double p = std::exp(lp);
        double d = (v == y ? g : 0.0) - p * g;
        if (p > 0.0) d -= gh * p * (lp + ref.entropy);
        d /= tau;
        const double got = to_float(grad.data[v]);
        // fp32 rounding of z / tau - lse (relative error of p about 1e-7 (|z / tau| + |lse|)),
        // then the rounding of the output to T.
        const double tol = 1e-5 * (std::fabs(g) + std::fabs(gh) * (std::fabs(lp) + 1.0)) +
                           std::fabs(d) * (2e-7 * (std::fabs(z[v] / tau) + std::fabs(ref.lse)) +
                                           (sizeof(T) == 2 ? 8e-3 : 1e-5));
        worst = std::fmax(worst, std::fabs(got - d) / tol);
      }
      expect(worst <= 1.0, "grad_logits (worst error / tolerance)", ctx, worst, 1.0);

      // Ignored rows: a zero gradient, whatever the logits.
      for (int64_t tid = 0; tid < B; ++tid) {
        logprobs_bwd_row<T, B, true>(row.data, grad.data, vocab, y, true, LogNorm{0.f, 0.f}, 0.f,
                                     0.f, 0.f, 1.f, tid);
      }
      int64_t nonzero = 0;
      for (int64_t v = 0; v < vocab; ++v) nonzero += to_float(grad.data[v]) != 0.f;
      expect(nonzero == 0, "ignored row gradient is zero", ctx, static_cast<double>(nonzero), 0);
    }
  }
}

// ---- JS distance

double js_ref(const std::vector<double>& zp, const std::vector<double>& zq, double tau) {
  auto log_softmax = [tau](const std::vector<double>& z) {
    double m = -INFINITY;
    for (double x : z) m = std::fmax(m, x / tau);
    double s = 0.0;
    for (double x : z) s += std::exp(x / tau - m);
    std::vector<double> out(z.size());
    for (size_t i = 0; i < z.size(); ++i) out[i] = z[i] / tau - m - std::log(s);
    return out;
  };
  const std::vector<double> lp = log_softmax(zp), lq = log_softmax(zq);
  double jsd = 0.0;
  for (size_t i = 0; i < zp.size(); ++i) {
    const double p = std::exp(lp[i]), q = std::exp(lq[i]);
    const double m = 0.5 * (p + q);
    if (p > 0.0) jsd += 0.5 * p * (lp[i] - std::log(m));
    if (q > 0.0) jsd += 0.5 * q * (lq[i] - std::log(m));
  }
  return std::sqrt(std::fmax(jsd, 0.0) / std::log(2.0));
}

// The js_kernel's work for one token, with simulated CTAs: out[k] for k < n_streams.
template <typename T, int KB>
void simulate_js_row(const T* logits_p, const T* logits_q, int64_t row, int64_t n_rows,
                     int64_t n_streams, int64_t vocab, float inv_temp, float* out) {
  constexpr int B = kJsBlock;
  constexpr int R = 1 + KB;
  LogNorm np{0.f, 0.f};
  for (int64_t k0 = 0; k0 < n_streams; k0 += KB) {
    const int kb = static_cast<int>(n_streams - k0 < KB ? n_streams - k0 : KB);
    const T* rows[R];
    js_group_rows<T, KB>(logits_p, logits_q, row, n_rows, vocab, k0, kb, rows);
    const unsigned mask1 = (((1u << kb) - 1u) << 1) | (k0 == 0 ? 1u : 0u);
    std::vector<MaxSumArray<R>> p1(B);
    for (int64_t tid = 0; tid < B; ++tid) {
      p1[tid] = js_pass1_partial<T, B, R>(rows, mask1, vocab, inv_temp, tid);
    }
    const MaxSumArray<R> st = simulate_block_allreduce(p1, MaxSumArrayMerge<R>{2.f * inv_temp});
    if (k0 == 0) np = st.v[0].log_norm();
    LogNorm nq[KB];
    for (int j = 0; j < KB; ++j) nq[j] = st.v[1 + j].log_norm();
    std::vector<FloatArray<KB>> p2(B);
    for (int64_t tid = 0; tid < B; ++tid) {
      p2[tid] = js_pass2_partial<T, B, KB>(rows, kb, vocab, inv_temp, np, nq, tid);
    }
    const FloatArray<KB> acc = simulate_block_allreduce(p2, FloatArraySum<KB>());
    for (int j = 0; j < kb; ++j) {
      out[k0 + j] = js_row_defined(np, nq[j]) ? js_distance_from_sum(acc.v[j]) : NAN;
    }
  }
}

// Kinds of Q row relative to P: 0 identical, 1 close (small perturbation), 2 unrelated,
// 3 disjoint support (-inf where P is finite and the reverse), 4 extreme logits, 5 very close
// (d ~ 1e-5, where the log form of the term would lose every digit to cancellation).
template <typename T>
void make_pair_q(const T* p, T* q, int64_t vocab, int kind, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = to_float(p[v]);
    float y = x;
    if (kind == 1) y = x + 0.01f * normal(rng);
    if (kind == 2) y = 2.f * normal(rng);
    if (kind == 3) y = (v % 2 == 0) ? -INFINITY : 0.3f * normal(rng);
    if (kind == 4) y = (v % 3 == 0) ? -1e4f : 1e4f;
    if (kind == 5) y = x + 1e-4f * normal(rng);
    q[v] = from_float<T>(y);
  }
}

template <typename T, int KB>
void check_js_case(int64_t vocab, int64_t n_rows, int64_t n_streams, size_t off,
                   std::mt19937& rng) {
  const float tau = 1.3f;
  Buffer<T> p(n_rows * vocab, off);
  Buffer<T> q(n_streams * n_rows * vocab, off + (vocab % 2));
  std::normal_distribution<float> normal(0.f, 2.f);
  for (int64_t i = 0; i < n_rows * vocab; ++i) {
    // Row r of kind 3 needs P finite only at odd v (disjoint from Q's even -inf pattern);
    // set -inf at odd v for every row whose stream kind will be 3.
    p.data[i] = from_float<T>(normal(rng));
  }
  std::vector<int> kinds(n_streams * n_rows);
  for (int64_t k = 0; k < n_streams; ++k) {
    for (int64_t r = 0; r < n_rows; ++r) {
      int kind = static_cast<int>((k + 2 * r) % 6);
      if (kind == 3 && vocab < 2) kind = 2;  // one entry cannot have disjoint supports
      kinds[k * n_rows + r] = kind;
    }
  }
  // Disjoint supports: P is -inf at odd entries on rows that some stream compares as kind 3;
  // that stream's Q is -inf at even entries.
  for (int64_t r = 0; r < n_rows; ++r) {
    bool disjoint = false;
    for (int64_t k = 0; k < n_streams; ++k) disjoint = disjoint || kinds[k * n_rows + r] == 3;
    if (!disjoint) continue;
    for (int64_t v = 1; v < vocab; v += 2) p.data[r * vocab + v] = from_float<T>(-INFINITY);
  }
  for (int64_t k = 0; k < n_streams; ++k) {
    for (int64_t r = 0; r < n_rows; ++r) {
      make_pair_q(p.data + r * vocab, q.data + (k * n_rows + r) * vocab, vocab,
                  kinds[k * n_rows + r], rng);
    }
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    std::vector<float> got(n_streams);
    simulate_js_row<T, KB>(p.data, q.data, r, n_rows, n_streams, vocab, 1.f / tau, got.data());
    const std::vector<double> zp = rounded(p.data + r * vocab, vocab);
    for (int64_t k = 0; k < n_streams; ++k) {
      const int kind = kinds[k * n_rows + r];
      const std::vector<double> zq = rounded(q.data + (k * n_rows + r) * vocab, vocab);
      const double want = js_ref(zp, zq, tau);
      char ctx[128];
      std::snprintf(ctx, sizeof(ctx), "%s V=%lld K=%lld KB=%d row=%lld stream=%lld kind=%d",
                    type_name<T>(), static_cast<long long>(vocab),
                    static_cast<long long>(n_streams), KB, static_cast<long long>(r),
                    static_cast<long long>(k), kind);
      if (kind == 0) {
        expect(got[k] == 0.f, "JS of identical rows is exactly 0", ctx, got[k], 0.0);
      } else if (kind == 3) {
        expect(close_to(got[k], 1.0, 1e-6, 0.0), "JS of disjoint supports is 1", ctx, got[k],
               1.0);
      } else {
        // Close rows: d is small, relative accuracy matters; others: absolute.
        const double atol = kind == 5 ? 1e-8 : 2e-6;
        expect(close_to(got[k], want, atol, 2e-4), "JS against float64", ctx, got[k], want);
      }
      expect(got[k] >= 0.f && got[k] <= 1.f, "JS in [0, 1]", ctx, got[k], want);
    }
  }
}

// Logits of magnitude 1e4: fp32 rounds lse there to 1e-3, which z - lse would pass on to
// every log p; the kernel keeps (max, log sum) apart, so disjoint supports still give 1.
template <typename T>
void check_js_extreme() {
  std::mt19937 rng(7);
  for (int64_t vocab : {int64_t{1001}, int64_t{151936}}) {
    Buffer<T> p(vocab, 0);
    Buffer<T> q(vocab, 0);
    for (int64_t v = 0; v < vocab; ++v) {
      const float x = (rng() & 1u) ? 1e4f : -1e4f;
      p.data[v] = from_float<T>(x);
      q.data[v] = from_float<T>(-x);
    }
    float got = 0.f;
    simulate_js_row<T, 1>(p.data, q.data, 0, 1, 1, vocab, 1.f / 0.9f, &got);
    char ctx[64];
    std::snprintf(ctx, sizeof(ctx), "%s V=%lld logits +-1e4", type_name<T>(),
                  static_cast<long long>(vocab));
    expect(close_to(got, 1.0, 5e-6, 0.0), "JS of disjoint extreme rows is 1", ctx, got, 1.0);
  }
}

template <typename T>
void check_js() {
  std::mt19937 rng(99);
  const int64_t vocabs[] = {1, 7, 1000, 5003, 151936};
  for (int64_t vocab : vocabs) {
    check_js_case<T, 1>(vocab, 5, 1, vocab % 4, rng);
    check_js_case<T, 4>(vocab, 5, 3, (vocab + 1) % 4, rng);
    if (vocab <= 5003) check_js_case<T, 4>(vocab, 3, 6, 0, rng);  // two groups of streams
  }
}

// The series pieces against float64 on their whole range.
void check_js_series() {
  double worst_tanh = 0.0, worst_h = 0.0;
  for (int i = -1000; i <= 1000; ++i) {
    const double u = 0.25 * i / 1000.0;
    worst_tanh = std::fmax(worst_tanh, std::fabs(tanh_small(static_cast<float>(u)) - std::tanh(u)) /
                                           (std::fabs(std::tanh(u)) + 1e-30));
    const double t = 0.245 * i / 1000.0;
    const double h = t == 0.0 ? 0.0 : (1 + t) * std::log1p(t) + (1 - t) * std::log1p(-t);
    worst_h = std::fmax(worst_h, std::fabs(h_small(static_cast<float>(t)) - h) / (h + 1e-30));
  }
  expect(worst_tanh < 1e-6, "tanh series relative error", "|u| <= 1/4", worst_tanh, 1e-6);
  expect(worst_h < 1e-6, "h series relative error", "|t| <= 0.245", worst_h, 1e-6);
  // m h(t) is continuous across the switch between the series and the log form.
  for (float half_delta : {0.2499f, 0.2501f, -0.2499f, -0.2501f}) {
    const float zq = -1.f, zp = zq + 2.f * half_delta;
    const float p = std::exp(zp), q = std::exp(zq);
    const double pd = std::exp(static_cast<double>(zp)), qd = std::exp(static_cast<double>(zq));
    const double md = 0.5 * (pd + qd);
    const double want = pd * std::log(pd / md) + qd * std::log(qd / md);
    const float got = js_term(zp, p, zq, zp - zq);
    expect(close_to(got, want, 0.0, 2e-5), "js_term near the series switch", "|delta/2| ~ 1/4",
           got, want);
  }
}

// ---- scaling, non-finite rows, out-of-range labels (README "Numerics")

// Rows near float max at tau < 1, where z / tau overflows: the raw-max shift keeps every
// answer finite and right. fp32 rows only (the other dtypes cannot hold these values).
void check_logprobs_scaling() {
  constexpr float kMax = 3.402823466e38f;
  const int64_t vocab = 67;
  for (float tau : {0.3f, 0.7f, 1.7f}) {
    for (float value : {kMax, -kMax, 1e38f}) {
      std::vector<float> row(vocab, value);
      const int64_t y = 5;
      const RowOut out = simulate_logprobs_row(row.data(), vocab, y, 1.f / tau);
      char ctx[96];
      std::snprintf(ctx, sizeof(ctx), "equal row %g tau=%g", value, tau);
      const double want = -std::log(static_cast<double>(vocab));
      expect(close_to(out.logp, want, 1e-5, 0.0), "logp of an equal row is -log V", ctx,
             out.logp, want);
      expect(close_to(out.entropy, -want, 1e-5, 0.0), "entropy of an equal row is log V", ctx,
             out.entropy, -want);
      const LogNorm nz = simulate_norm(row.data(), vocab, 1.f / tau);
      std::vector<float> grad(vocab);
      for (int64_t tid = 0; tid < kLogprobsBlock; ++tid) {
        logprobs_bwd_row<float, kLogprobsBlock, false>(row.data(), grad.data(), vocab, y, false,
                                                       nz, 0.f, 1.f, 0.f, 1.f / tau, tid);
      }
      double worst = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        const double d = ((v == y ? 1.0 : 0.0) - 1.0 / vocab) / tau;
        worst = std::fmax(worst, std::fabs(grad[v] - d));
      }
      expect(worst < 1e-5, "gradient of an equal row", ctx, worst, 0.0);
    }
    // Both ends of the float range in one row: z / tau overflows both ways.
    std::vector<float> row(vocab, 0.f);
    for (int v = 0; v < 3; ++v) row[v] = kMax;
    for (int v = 3; v < 6; ++v) row[v] = -kMax;
    char ctx[64];
    std::snprintf(ctx, sizeof(ctx), "spread row tau=%g", tau);
    const RowOut top = simulate_logprobs_row(row.data(), vocab, 1, 1.f / tau);
    expect(close_to(top.logp, -std::log(3.0), 1e-6, 0.0), "logp of a top entry", ctx, top.logp,
           -std::log(3.0));
    expect(close_to(top.entropy, std::log(3.0), 1e-6, 0.0), "entropy of the spread row", ctx,
           top.entropy, std::log(3.0));
    const RowOut low = simulate_logprobs_row(row.data(), vocab, 4, 1.f / tau);
    const double want = -2.0 * static_cast<double>(kMax) / tau;  // beyond fp32 at tau < 2
    expect(low.logp == -INFINITY || close_to(low.logp, want, 0.0, 1e-6),
           "logp of a bottom entry (-inf where beyond fp32)", ctx, low.logp, want);
  }
  // A random row of magnitude 1e30 / tau, against float64 (the raw shift's one rounding).
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (float tau : {0.3f, 1.7f}) {
    std::vector<float> row(1001);
    for (auto& x : row) x = 1e30f * tau * normal(rng);
    const int64_t y = static_cast<int64_t>(std::max_element(row.begin(), row.end()) - row.begin());
    std::vector<double> z(row.begin(), row.end());
    const RowRef ref = logprobs_ref(z, y, tau);
    const RowOut out = simulate_logprobs_row(row.data(), 1001, y, 1.f / tau);
    char ctx[64];
    std::snprintf(ctx, sizeof(ctx), "|z / tau| ~ 1e30, tau=%g", tau);
    expect(close_to(out.logp, ref.logp, 1e-6, 0.0), "logp of the top entry", ctx, out.logp,
           ref.logp);
    expect(close_to(out.entropy, ref.entropy, 1e-6, 0.0), "entropy", ctx, out.entropy,
           ref.entropy);
  }
}

template <typename T>
void check_nonfinite_and_labels() {
  const int64_t vocab = 1001;
  const float inv_t = 1.f / 0.7f;
  // Labels the backward leaves at zero: ignored and out of range; not an in-range one.
  expect(logprobs_row_skipped(-100, -100, vocab) && logprobs_row_skipped(vocab, -100, vocab) &&
             logprobs_row_skipped(-7, -100, vocab) && logprobs_row_skipped(int64_t{1} << 40, -100, vocab) &&
             !logprobs_row_skipped(0, -100, vocab) && !logprobs_row_skipped(vocab - 1, -100, vocab),
         "rows skipped by the backward: ignored and out-of-range labels", type_name<T>(), 0, 0);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 2.f);
  Buffer<T> finite(vocab, 1);
  for (int64_t v = 0; v < vocab; ++v) finite.data[v] = from_float<T>(normal(rng));
  const RowOut oob = simulate_logprobs_row(finite.data, vocab, vocab, inv_t);
  expect(std::isnan(oob.logp), "logp NaN for a label outside [0, V)", type_name<T>(), oob.logp,
         NAN);
  // NaN anywhere, +inf anywhere, nothing but -inf: NaN log-prob, entropy, gradient and JS.
  for (int kind = 0; kind < 3; ++kind) {
    Buffer<T> bad(vocab, 1);
    for (int64_t v = 0; v < vocab; ++v) {
      bad.data[v] = kind == 2 ? from_float<T>(-INFINITY) : finite.data[v];
    }
    if (kind == 0) bad.data[vocab / 3] = from_float<T>(NAN);
    if (kind == 1) bad.data[vocab - 2] = from_float<T>(INFINITY);
    char ctx[64];
    std::snprintf(ctx, sizeof(ctx), "%s %s row", type_name<T>(),
                  kind == 0 ? "NaN" : kind == 1 ? "+inf" : "all -inf");
    const RowOut out = simulate_logprobs_row(bad.data, vocab, 3, inv_t);
    expect(std::isnan(out.logp) && std::isnan(out.entropy), "logp and entropy NaN", ctx,
           out.logp, NAN);
    const LogNorm nz = simulate_norm(bad.data, vocab, inv_t);
    Buffer<T> grad(vocab, 1);
    for (int64_t tid = 0; tid < kLogprobsBlock; ++tid) {
      logprobs_bwd_row<T, kLogprobsBlock, false>(bad.data, grad.data, vocab, 3, false, nz, 0.f,
                                                 1.f, 0.f, inv_t, tid);
    }
    int64_t not_nan = 0;
    for (int64_t v = 0; v < vocab; ++v) not_nan += !std::isnan(to_float(grad.data[v]));
    expect(not_nan == 0, "gradient row NaN", ctx, static_cast<double>(not_nan), 0.0);
    float d[2] = {0.f, 0.f};
    simulate_js_row<T, 1>(bad.data, finite.data, 0, 1, 1, vocab, inv_t, d);
    simulate_js_row<T, 1>(finite.data, bad.data, 0, 1, 1, vocab, inv_t, d + 1);
    expect(std::isnan(d[0]) && std::isnan(d[1]), "JS NaN on either side, never 0", ctx, d[0],
           NAN);
  }
}

// JS at scales where z / tau overflows: identical rows 0, P and Q with the same top entries 0.
void check_js_scaling() {
  constexpr float kMax = 3.402823466e38f;
  const int64_t vocab = 67;
  std::vector<float> p(vocab), q(vocab);
  for (int64_t v = 0; v < vocab; ++v) {
    p[v] = (v == 7) ? kMax : -kMax + static_cast<float>(v) * 1e36f;
    q[v] = (v == 7) ? kMax : -0.5f * kMax;
  }
  for (float tau : {0.3f, 1.f}) {
    float d[2] = {1.f, 1.f};
    simulate_js_row<float, 1>(p.data(), p.data(), 0, 1, 1, vocab, 1.f / tau, d);
    simulate_js_row<float, 1>(p.data(), q.data(), 0, 1, 1, vocab, 1.f / tau, d + 1);
    char ctx[48];
    std::snprintf(ctx, sizeof(ctx), "rows near float max, tau=%g", tau);
    expect(d[0] == 0.f, "JS of identical extreme rows is 0", ctx, d[0], 0.0);
    expect(close_to(d[1], 0.0, 1e-6, 0.0), "JS of one-hot rows on the same entry is 0", ctx,
           d[1], 0.0);
  }
  // Rows of different scales: P one-hot at a huge logit, Q of order 1 (log p - log q must not
  // come from cancelling two huge raw differences).
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<float> big(vocab), small(vocab);
  for (int64_t v = 0; v < vocab; ++v) {
    small[v] = normal(rng);
    big[v] = normal(rng);
  }
  big[3] = 3e38f;
  big[7] = -3e38f;
  small[11] = 30.f;  // Q's mass at another entry: log s_q ~ 0, log q at P's top ~ -30 / tau
  for (float tau : {0.9f, 1.f, 2.f}) {
    float d = 0.f;
    simulate_js_row<float, 1>(big.data(), small.data(), 0, 1, 1, vocab, 1.f / tau, &d);
    const double want = js_ref(std::vector<double>(big.begin(), big.end()),
                               std::vector<double>(small.begin(), small.end()), tau);
    char ctx[48];
    std::snprintf(ctx, sizeof(ctx), "one-hot huge P vs order-1 Q, tau=%g", tau);
    expect(close_to(d, want, 2e-6, 0.0), "JS of rows of different scales", ctx, d, want);
  }
}

// ---- reallocation weights

void check_allocation_weight() {
  ReallocateParams prm{0.7f, 1.f, 1e-8f, 0.f, INFINITY, false};
  const float d = 0.3f, scale = 0.2f;
  expect(close_to(allocation_weight(d, scale, 1.f, prm), 0.3 + 0.7 * 1.5, 1e-6, 0.0),
         "allocation weight", "gamma=1", allocation_weight(d, scale, 1.f, prm), 1.35);
  expect(allocation_weight(d, 0.f, 1.f, prm) == 1.f, "uniform weight where scale = 0",
         "scale=0", allocation_weight(d, 0.f, 1.f, prm), 1.0);
  prm.gamma = 2.5f;
  const double want = 0.3 + 0.7 * std::pow(0.3, 2.5) / 0.2;
  expect(close_to(allocation_weight(d, scale, 1.f, prm), want, 1e-6, 1e-6), "allocation weight",
         "gamma=2.5", allocation_weight(d, scale, 1.f, prm), want);
  expect(relevance_power(-0.5f, 2.5f) == 0.f && relevance_power(0.f, 0.5f) == 0.f,
         "relevance power of d <= 0 is 0", "gamma=2.5/0.5", relevance_power(-0.5f, 2.5f), 0.0);
  prm.gamma = 1.f;
  prm.clip = true;
  prm.clip_min = 0.5f;
  prm.clip_max = 1.2f;
  const double clipped = 0.3 + 0.7 * 1.2 / 0.9;
  expect(close_to(allocation_weight(d, scale, 0.9f, prm), clipped, 1e-6, 1e-6),
         "clipped allocation weight", "clip=(0.5,1.2)", allocation_weight(d, scale, 0.9f, prm),
         clipped);
}

int main() {
  check_row_coverage<float>();
  check_row_coverage<__nv_bfloat16>();
  check_row_coverage<__half>();
  check_logprobs<float>();
  check_logprobs<__nv_bfloat16>();
  check_logprobs<__half>();
  check_js_series();
  check_js<float>();
  check_js<__nv_bfloat16>();
  check_js<__half>();
  check_js_extreme<float>();
  check_js_extreme<__nv_bfloat16>();
  check_js_extreme<__half>();
  check_logprobs_scaling();
  check_nonfinite_and_labels<float>();
  check_nonfinite_and_labels<__nv_bfloat16>();
  check_nonfinite_and_labels<__half>();
  check_js_scaling();
  check_allocation_weight();
  std::printf("%d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
