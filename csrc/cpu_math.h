// Vectorisable math shared by the C++ CPU kernels (token_stats, topk).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace dspec {
namespace cpu {

#ifndef DSPEC_CPU_INLINE
#define DSPEC_CPU_INLINE inline __attribute__((always_inline))
#endif

// exp(x) for x <= 0 (the only arguments the algorithm produces; -inf and NaN give 0).
// Branch-free so that the lane loop vectorises: Cody-Waite reduction by ln 2 and the
// degree-6 polynomial of Cephes' expf (about 1 ulp on [-87, 0]); results below 2^-126
// (x < ~-87.3) are 0, which no sum of at least one exp(0) = 1 term can notice.
DSPEC_CPU_INLINE float exp_nonpos(float x) {
  float xc = x > -88.0f ? x : -88.0f;  // NaN and -inf -> -88 -> 0
  xc = xc < 0.0f ? xc : 0.0f;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + shifter) - shifter;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  const float poly = q * r * r + r + 1.0f;
  const std::int32_t ni = static_cast<std::int32_t>(n);  // in [-127, 0]
  const float scale = dt::f32_from_bits(static_cast<std::uint32_t>(ni + 127) << 23);  // 2^n, 0 for n = -127
  return poly * scale;
}

}  // namespace cpu
}  // namespace dspec
