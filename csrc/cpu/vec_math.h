// Branch-free float exp and log that GCC/Clang auto-vectorize inside `#pragma omp simd`
// loops (libm's expf/logf are calls that block vectorization). Torch-free.
//
// exp: x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2, exp(r) by a degree-6
//      polynomial (Cephes coefficients), 2^n by building the exponent bits. Max relative
//      error ~2 ulp on [-87.3, 88.7]; returns 0 below -87.3 (the fp32 normal range ends
//      there) and saturates at the top.
// log: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(m) = f - f^2/2 + f^3 P(f), f = m - 1,
//      (Cephes coefficients); valid for normal positive x (callers mask the rest).
//
// double overloads forward to <cmath> (the float64 path exists for gradcheck, not speed).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mrtpo {

static inline float bits_to_float(int32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

static inline int32_t float_to_bits(float f) {
  int32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

static inline float vexp(float x) {
  const float lo = -87.3f, hi = 88.7f;
  const float xc = x < lo ? lo : (x > hi ? hi : x);
  // Round to nearest by adding 1.5 * 2^23 (no libm call, so the loop vectorizes).
  const float shifter = 12582912.0f;
  const float n = (xc * 1.44269504088896341f + shifter) - shifter;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  const float scale = bits_to_float((static_cast<int32_t>(n) + 127) << 23);
  return x < lo ? 0.0f : y * scale;
}

static inline float vlog(float x) {
  int32_t b = float_to_bits(x);
  const float e0 = static_cast<float>(((b >> 23) & 0xff) - 126);  // x = m 2^e, m in [0.5, 1)
  b = (b & 0x007fffff) | 0x3f000000;
  float m = bits_to_float(b);
  const bool small = m < 0.707106781186547524f;
  const float e = small ? e0 - 1.0f : e0;
  const float f = small ? (m + m - 1.0f) : (m - 1.0f);
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return f + y + 0.693359375f * e;
}

static inline double vexp(double x) { return std::exp(x); }
static inline double vlog(double x) { return std::log(x); }

}  // namespace mrtpo
