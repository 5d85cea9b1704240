// Vectorisable math shared by the C++ CPU kernels (token_stats, topk, cascade_attention).
#pragma once

#include <cstdint>

#include "cpu_features.h"
#include "dtype.h"

namespace dspec {
namespace cpu {

#ifndef DSPEC_CPU_INLINE
#define DSPEC_CPU_INLINE inline __attribute__((always_inline))
#endif

// An entry point compiled for AVX-512 (x86-64-v4), AVX2 + FMA (x86-64-v3) and baseline
// x86-64, picked at each call by the instruction-set level the kernels run at
// (cpu::isa_level(): the CPU's, capped by $DSPEC_CPU_ISA): the branch-free loops of the
// body vectorise in each copy.  Written
//
//   DSPEC_CPU_MULTI(void, name, (const Args& a, std::int64_t lo), (a, lo)) { body }
//
// the body becomes an always-inlined function that each copy inlines.  The copies compute
// the same bits (the files whose results must not depend on the copy are compiled without
// FMA contraction, CMakeLists.txt).  DSPEC_CPU_MULTI_V3 makes only the AVX2 and baseline
// copies (code with its own AVX-512 intrinsics beside it).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DSPEC_TARGET_V4 __attribute__((target("arch=x86-64-v4")))
#define DSPEC_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#define DSPEC_CPU_MULTI(ret, name, params, args)                                \
  static inline __attribute__((always_inline)) ret name##_body params;          \
  DSPEC_TARGET_V4 static ret name##_v4 params { return name##_body args; }      \
  DSPEC_TARGET_V3 static ret name##_v3 params { return name##_body args; }      \
  static ret name##_v1 params { return name##_body args; }                      \
  ret name params {                                                             \
    const int level = ::dspec::cpu::isa_level();                                \
    if (level >= ::dspec::cpu::kLevelAvx512) return name##_v4 args;             \
    return level >= ::dspec::cpu::kLevelAvx2 ? name##_v3 args : name##_v1 args; \
  }                                                                             \
  static inline __attribute__((always_inline)) ret name##_body params
#define DSPEC_CPU_MULTI_V3(ret, name, params, args)                                      \
  static inline __attribute__((always_inline)) ret name##_body params;                   \
  DSPEC_TARGET_V3 static ret name##_v3 params { return name##_body args; }               \
  static ret name##_v1 params { return name##_body args; }                               \
  ret name params { return ::dspec::cpu::has_avx2() ? name##_v3 args : name##_v1 args; } \
  static inline __attribute__((always_inline)) ret name##_body params
#else
#define DSPEC_CPU_MULTI(ret, name, params, args) ret name params
#define DSPEC_CPU_MULTI_V3(ret, name, params, args) ret name params
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
  const std::int32_t ni = static_cast<std::int32_t>(n);                               // in [-127, 0]
  const float scale = dt::f32_from_bits(static_cast<std::uint32_t>(ni + 127) << 23);  // 2^n, 0 for n = -127
  return poly * scale;
}

// 2^x for x <= 0 (-inf and NaN give 0), branch-free: x = n + f, 2^f by Cephes' exp2f
// polynomial on [-0.5, 0.5] (about 1 ulp), 2^n by the exponent bits; 0 below 2^-126.
DSPEC_CPU_INLINE float exp2_nonpos(float x) {
  float xc = x > -126.0f ? x : -126.0f;
  xc = xc < 0.0f ? xc : 0.0f;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc + shifter) - shifter;
  const float f = xc - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const std::int32_t ni = static_cast<std::int32_t>(n);  // in [-126, 0]
  const float scale = dt::f32_from_bits(static_cast<std::uint32_t>(ni + 127) << 23);
  return x > -126.0f ? p * scale : 0.0f;
}

}  // namespace cpu
}  // namespace dspec
