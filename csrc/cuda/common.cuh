// Device helpers shared by the mrtpo CUDA kernels. Torch-free: CUDA runtime, cuda_fp16.h,
// cuda_bf16.h and the standard library only, so the kernels compile with plain nvcc.
//
// Contents
//   to_float / from_float    element conversions, fp32 math from fp32 / bf16 / fp16 storage
//   Pack<T>                  one 16-byte vector: 4 fp32 or 8 bf16 / fp16 elements
//   RowSplit                 a row cut into an unaligned head, 16-byte vectors and a tail
//   scaled_diff              x = (z - m) / tau without overflow (the raw-max shift)
//   LseState                 online log-sum-exp (raw running max m, s = sum e^x,
//                            t = sum e^x x for the entropy), and its merge
//   block_allreduce          CTA-wide reduction of any mergeable state, result in every thread
//
// Conventions: element offsets are int64_t (row * V exceeds 2^31 at N = 16384, V = 151936);
// the max identity is -inf; a state with s == 0 is empty whatever its m.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace mrtpo {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr float kLn2 = 0.693147180559945309f;

// Per-element math and the per-thread row loops are host-device, so the same code also runs
// on the CPU in tests/cuda_harness (one simulated thread at a time); the CTA reductions and
// the kernels are device-only.
#define MRTPO_HD __host__ __device__ __forceinline__

// `#pragma unroll` for the device pass only (the host compiler does not know it).
#ifdef __CUDA_ARCH__
#define MRTPO_UNROLL _Pragma("unroll")
#else
#define MRTPO_UNROLL
#endif

// exp / log: the MUFU approximations on the GPU (about 2 ulp, what --use_fast_math gives),
// the C library on the host.
MRTPO_HD float fast_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return std::exp(x);
#endif
}

MRTPO_HD float fast_log(float x) {
#ifdef __CUDA_ARCH__
  return __logf(x);
#else
  return std::log(x);
#endif
}

// ------------------------------------------------------------------ element conversions

MRTPO_HD float to_float(float x) { return x; }
MRTPO_HD float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
MRTPO_HD float to_float(__half x) { return __half2float(x); }

template <typename T>
MRTPO_HD T from_float(float x);
template <>
MRTPO_HD float from_float<float>(float x) {
  return x;
}
template <>
MRTPO_HD __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
MRTPO_HD __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// ------------------------------------------------------------------ 16-byte vectors

// Pack<T>: kSize elements of T in one 16-byte word, loaded and stored as a uint4 so that a
// warp moves 512 contiguous bytes per instruction (full 128-byte lines, no partial sectors).
template <typename T>
struct Pack {
  static constexpr int kSize = 16 / static_cast<int>(sizeof(T));
  union {
    uint4 raw;
    T elem[kSize];
  };
  MRTPO_HD Pack() : raw(make_uint4(0u, 0u, 0u, 0u)) {}
};

// Read-only loads through the non-coherent path (the logits are never written while a
// kernel reads them). load_pack: `ptr` must be 16-byte aligned.
template <typename T>
MRTPO_HD T load_elem(const T* ptr) {
#ifdef __CUDA_ARCH__
  return __ldg(ptr);
#else
  return *ptr;
#endif
}

template <typename T>
MRTPO_HD Pack<T> load_pack(const T* ptr) {
  Pack<T> p;
#ifdef __CUDA_ARCH__
  p.raw = __ldg(reinterpret_cast<const uint4*>(ptr));
#else
  p.raw = *reinterpret_cast<const uint4*>(ptr);
#endif
  return p;
}

// Streaming 16-byte store (evict-first: the gradient is not read again by this kernel).
template <typename T>
MRTPO_HD void store_pack(T* ptr, const Pack<T>& p) {
#ifdef __CUDA_ARCH__
  __stcs(reinterpret_cast<uint4*>(ptr), p.raw);
#else
  *reinterpret_cast<uint4*>(ptr) = p.raw;
#endif
}

MRTPO_HD unsigned misalignment16(const void* ptr) {
  return static_cast<unsigned>(reinterpret_cast<uintptr_t>(ptr) & 15u);
}

// A row of `vocab` elements of T starting at an address with misalignment `mis` (bytes mod
// 16, a multiple of sizeof(T)) splits into `head` scalar elements up to the first 16-byte
// boundary, `nvec` whole Pack<T> vectors, and a scalar tail from `tail_begin` to vocab.
// Several rows can share one split when their misalignments are equal.
struct RowSplit {
  int64_t head;
  int64_t nvec;
  int64_t tail_begin;

  template <typename T>
  MRTPO_HD static RowSplit make(unsigned mis, int64_t vocab) {
    constexpr int64_t kVec = Pack<T>::kSize;
    int64_t head = mis == 0 ? 0 : static_cast<int64_t>((16u - mis) / sizeof(T));
    head = head < vocab ? head : vocab;
    const int64_t nvec = (vocab - head) / kVec;
    return RowSplit{head, nvec, head + nvec * kVec};
  }
};

// ------------------------------------------------------------------ online log-sum-exp

// Scaling (README "Numerics"): each row is shifted by its RAW maximum m before the
// temperature, x = (z - m) / tau, formed as (z/2 - m/2)(2/tau): the halves cannot overflow,
// so finite logits never overflow through z / tau (at tau < 1 near float max), and the
// maximum entry gives exactly 0. two_inv_t = 2 / tau.
MRTPO_HD float scaled_diff(float z, float m, float two_inv_t) {
  return (0.5f * z - 0.5f * m) * two_inv_t;
}

// Running statistics of a stream of raw logits z at temperature tau:
//   m = max z (raw),  x = (z - m) / tau,  s = sum e^x,  t = sum e^x x
// so that lse = m / tau + log s and the entropy H = log s - t / s. Keeping t relative to m
// avoids the cancellation of lse - E_p[z / tau] when |z / tau| is large. A NaN or +inf
// element makes s NaN, and a NaN state wins every merge: the row's statistics are NaN.
struct LseState {
  float m;
  float s;
  float t;

  MRTPO_HD static LseState empty() { return LseState{-INFINITY, 0.f, 0.f}; }

  // Add one element. WITH_T: also track t (only the entropy needs it).
  template <bool WITH_T>
  MRTPO_HD void push(float z, float two_inv_t) {
    if (z > m) {
      // New max: rescale what we have by e^x(m_old); t shifts by x(m_old) s.
      if (s > 0.f) {
        const float shift = scaled_diff(m, z, two_inv_t);
        const float a = fast_exp(shift);
        // a = 0 (the old entries underflow, shift may be -inf): t is 0, not 0 * -inf
        if (WITH_T) t = a > 0.f ? a * (t + shift * s) : 0.f;
        s *= a;
      }
      m = z;
    }
    const float d = scaled_diff(z, m, two_inv_t);  // <= 0, NaN for z = m = +-inf or NaN z
    const float e = (z == -INFINITY) ? 0.f : fast_exp(d);
    s += e;
    if (WITH_T) t += (e > 0.f) ? e * d : 0.f;
  }

  MRTPO_HD float lse(float inv_t) const { return m * inv_t + fast_log(s); }
  MRTPO_HD float entropy() const { return fast_log(s) - t / s; }
};

// Merge two online states: rescale both to M = max(m_a, m_b). A NaN sum (the row held a
// NaN or +inf) propagates.
struct LseMerge {
  float two_inv_t;
  MRTPO_HD LseState operator()(const LseState& a, const LseState& b) const {
    // s == 0 only for an empty state (a pushed finite z adds e^0 = 1 at the max); a NaN s
    // (a NaN or +inf pushed) is not 0 and flows into the merged sum
    if (a.s == 0.f) return b;
    if (b.s == 0.f) return a;
    const float mx = fmaxf(a.m, b.m);
    const float da = scaled_diff(a.m, mx, two_inv_t);
    const float db = scaled_diff(b.m, mx, two_inv_t);
    const float ea = fast_exp(da);
    const float eb = fast_exp(db);
    // a part whose weight underflows (da may be -inf) adds nothing to t, not 0 * -inf
    const float ta = ea > 0.f ? ea * (a.t + da * a.s) : 0.f;
    const float tb = eb > 0.f ? eb * (b.t + db * b.s) : 0.f;
    return LseState{mx, ea * a.s + eb * b.s, ta + tb};
  }
};

// A row's log-normalizer kept as its two parts, the raw max m and log s:
// log p = (z - m) / tau - log s keeps the digits that z / tau - lse loses to the rounding of
// lse when |m / tau| is large (fp32 ulp at 1e4 is 1e-3), and never forms z / tau.
struct LogNorm {
  float m;
  float log_s;

  MRTPO_HD float log_prob(float z, float two_inv_t) const {
    return scaled_diff(z, m, two_inv_t) - log_s;
  }
};

// Running max / sum pair (no entropy statistic): half the registers of LseState.
struct MaxSum {
  float m;
  float s;

  MRTPO_HD static MaxSum empty() { return MaxSum{-INFINITY, 0.f}; }

  MRTPO_HD void push(float z, float two_inv_t) {
    if (z > m) {
      if (s > 0.f) s *= fast_exp(scaled_diff(m, z, two_inv_t));
      m = z;
    }
    s += (z == -INFINITY) ? 0.f : fast_exp(scaled_diff(z, m, two_inv_t));
  }

  MRTPO_HD LogNorm log_norm() const { return LogNorm{m, fast_log(s)}; }
};

struct MaxSumMerge {
  float two_inv_t;
  MRTPO_HD MaxSum operator()(const MaxSum& a, const MaxSum& b) const {
    // s == 0 only for an empty state (a pushed finite z adds e^0 = 1 at the max); a NaN s
    // (a NaN or +inf pushed) is not 0 and flows into the merged sum
    if (a.s == 0.f) return b;
    if (b.s == 0.f) return a;
    const float mx = fmaxf(a.m, b.m);
    return MaxSum{mx, fast_exp(scaled_diff(a.m, mx, two_inv_t)) * a.s +
                          fast_exp(scaled_diff(b.m, mx, two_inv_t)) * b.s};
  }
};

struct SumMerge {
  MRTPO_HD float operator()(float a, float b) const { return a + b; }
};

// ------------------------------------------------------------------ CTA reductions

// Shuffle a trivially copyable state of 4-byte words across lanes.
template <typename S>
__device__ __forceinline__ S shfl_xor_state(const S& x, int lane_mask) {
  static_assert(sizeof(S) % 4 == 0, "state must be made of 4-byte words");
  constexpr int kWords = static_cast<int>(sizeof(S) / 4);
  S out;
  const float* src = reinterpret_cast<const float*>(&x);
  float* dst = reinterpret_cast<float*>(&out);
MRTPO_UNROLL
  for (int w = 0; w < kWords; ++w) dst[w] = __shfl_xor_sync(0xffffffffu, src[w], lane_mask);
  return out;
}

template <typename S, typename Merge>
__device__ __forceinline__ S warp_allreduce(S x, Merge merge) {
MRTPO_UNROLL
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) x = merge(x, shfl_xor_state(x, mask));
  return x;
}

// Reduce `x` over the CTA; every thread gets the result. `scratch` holds BLOCK / 32 states
// in shared memory. Ends with a barrier, so the scratch space may be reused right after.
template <int BLOCK, typename S, typename Merge>
__device__ __forceinline__ S block_allreduce(S x, Merge merge, S* scratch) {
  static_assert(BLOCK % kWarpSize == 0 && BLOCK <= 1024, "BLOCK: whole warps, at most 1024");
  constexpr int kWarps = BLOCK / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  x = warp_allreduce(x, merge);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  // Every thread merges the per-warp results in the same order: the result is bitwise the
  // same in all threads (and for two rows with equal data, the same for both rows).
  S y = scratch[0];
MRTPO_UNROLL
  for (int w = 1; w < kWarps; ++w) y = merge(y, scratch[w]);
  __syncthreads();
  return y;
}

// ------------------------------------------------------------------ row streaming

// Call f(v, x) for every element v of one row (x: the element as fp32) that thread `tid` of
// a CTA of BLOCK threads owns. The aligned body moves 16 bytes per load, UNROLL loads in
// flight per thread before any is used; the head and tail use scalar loads.
// f may be a host-only callable (the CPU harness); the check is per instantiation.
#pragma nv_exec_check_disable
template <typename T, int BLOCK, int UNROLL, typename F>
MRTPO_HD void for_each_in_row(const T* __restrict__ row, int64_t vocab, int64_t tid, F& f) {
  constexpr int kVec = Pack<T>::kSize;
  const RowSplit sp = RowSplit::make<T>(misalignment16(row), vocab);
  for (int64_t v = tid; v < sp.head; v += BLOCK) f(v, to_float(load_elem(row + v)));
  const T* body = row + sp.head;
  int64_t i = tid;
  for (; i + (UNROLL - 1) * BLOCK < sp.nvec; i += UNROLL * BLOCK) {
    Pack<T> pk[UNROLL];
MRTPO_UNROLL
    for (int u = 0; u < UNROLL; ++u) pk[u] = load_pack(body + (i + u * BLOCK) * kVec);
MRTPO_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t v0 = sp.head + (i + u * BLOCK) * kVec;
MRTPO_UNROLL
      for (int e = 0; e < kVec; ++e) f(v0 + e, to_float(pk[u].elem[e]));
    }
  }
  for (; i < sp.nvec; i += BLOCK) {
    const Pack<T> pk = load_pack(body + i * kVec);
    const int64_t v0 = sp.head + i * kVec;
MRTPO_UNROLL
    for (int e = 0; e < kVec; ++e) f(v0 + e, to_float(pk.elem[e]));
  }
  for (int64_t v = sp.tail_begin + tid; v < vocab; v += BLOCK) f(v, to_float(load_elem(row + v)));
}

// out[v] = f(v, in[v]) over one row, in and out in T, fp32 in between. READ = false skips
// the loads (f gets 0). Vectorized when in and out share their 16-byte misalignment.
// f may be a host-only callable (the CPU harness); the check is per instantiation.
#pragma nv_exec_check_disable
template <typename T, int BLOCK, int UNROLL, bool READ, typename F>
MRTPO_HD void map_row(const T* __restrict__ in, T* __restrict__ out, int64_t vocab, int64_t tid,
                      F& f) {
  constexpr int kVec = Pack<T>::kSize;
  const unsigned mis = misalignment16(out);
  if (READ && misalignment16(in) != mis) {
    for (int64_t v = tid; v < vocab; v += BLOCK) out[v] = from_float<T>(f(v, to_float(in[v])));
    return;
  }
  const RowSplit sp = RowSplit::make<T>(mis, vocab);
  for (int64_t v = tid; v < sp.head; v += BLOCK) {
    out[v] = from_float<T>(f(v, READ ? to_float(load_elem(in + v)) : 0.f));
  }
  int64_t i = tid;
  for (; i + (UNROLL - 1) * BLOCK < sp.nvec; i += UNROLL * BLOCK) {
    Pack<T> pk[UNROLL];
    if (READ) {
MRTPO_UNROLL
      for (int u = 0; u < UNROLL; ++u) pk[u] = load_pack(in + sp.head + (i + u * BLOCK) * kVec);
    }
MRTPO_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t v0 = sp.head + (i + u * BLOCK) * kVec;
MRTPO_UNROLL
      for (int e = 0; e < kVec; ++e) {
        pk[u].elem[e] = from_float<T>(f(v0 + e, READ ? to_float(pk[u].elem[e]) : 0.f));
      }
      store_pack(out + v0, pk[u]);
    }
  }
  for (; i < sp.nvec; i += BLOCK) {
    const int64_t v0 = sp.head + i * kVec;
    Pack<T> pk;
    if (READ) pk = load_pack(in + v0);
MRTPO_UNROLL
    for (int e = 0; e < kVec; ++e) {
      pk.elem[e] = from_float<T>(f(v0 + e, READ ? to_float(pk.elem[e]) : 0.f));
    }
    store_pack(out + v0, pk);
  }
  for (int64_t v = sp.tail_begin + tid; v < vocab; v += BLOCK) {
    out[v] = from_float<T>(f(v, READ ? to_float(load_elem(in + v)) : 0.f));
  }
}

}  // namespace cuda
}  // namespace mrtpo
