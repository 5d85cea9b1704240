// Element conversions shared by the C++ CPU code and the CUDA kernels: IEEE binary16 and
// bfloat16 bit patterns <-> float, and typed loads / stores by dtype code (dspec.h).
// Plain C++17 plus device fast paths (cuda_fp16.h only under nvcc); branch-free on the host
// and always inlined there, so that the CPU hot loops over them (token_stats_cpu.cpp)
// vectorise.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dspec.h"  // dtype codes

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define DSPEC_DT_INLINE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define DSPEC_DT_INLINE inline __attribute__((always_inline))
#else
#define DSPEC_DT_INLINE inline
#endif

namespace dspec {
namespace dt {

// Storage type of one element: float, or the raw uint16 bit pattern of a 16-bit float.
template <int DT>
using elem_t = std::conditional_t<DT == kFloat32, float, std::uint16_t>;

DSPEC_DT_INLINE float f32_from_bits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

DSPEC_DT_INLINE std::uint32_t bits_from_f32(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// binary16 -> binary32, exact: normals re-biased, subnormals as mant * 2^-24 (integer ->
// float, immune to denormals-are-zero), +-0, +-inf, NaNs (payload kept, made quiet).
DSPEC_DT_INLINE float half_to_float(std::uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const std::uint32_t u = h;
  const std::uint32_t sign = (u & 0x8000u) << 16;
  const std::uint32_t exp = u & 0x7c00u;
  const std::uint32_t mant = u & 0x03ffu;
  const float normal = f32_from_bits(((u & 0x7fffu) << 13) + ((127u - 15u) << 23));
  const float subnormal = static_cast<float>(static_cast<std::int32_t>(mant)) * 5.9604644775390625e-08f;
  const float special = f32_from_bits(0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u));
  const float mag = exp == 0 ? subnormal : (exp == 0x7c00u ? special : normal);
  return f32_from_bits(bits_from_f32(mag) | sign);
#endif
}

DSPEC_DT_INLINE float bf16_to_float(std::uint16_t h) { return f32_from_bits(static_cast<std::uint32_t>(h) << 16); }

// binary32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
DSPEC_DT_INLINE std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// binary32 -> binary16, round to nearest even, with subnormals, overflow to inf and NaN.
DSPEC_DT_INLINE std::uint16_t float_to_half(float f) {
  const std::uint32_t u = bits_from_f32(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (a < 0x38800000u) {                               // below the smallest normal half: scale into the subnormal grid
    const float mag = f32_from_bits(a) * 16777216.0f;  // * 2^24, exact
    // round half to even on the integer grid of 2^-24 steps
    const float r = mag + 12582912.0f - 12582912.0f;  // 1.5 * 2^23 trick (RNE in float)
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(r));
  }
  const std::uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);  // RNE on the dropped 13 bits
  return static_cast<std::uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
}

// One stored element of dtype DT as a float.
template <int DT>
DSPEC_DT_INLINE float to_float(elem_t<DT> v) {
  if constexpr (DT == kFloat32) {
    return v;
  } else if constexpr (DT == kFloat16) {
    return half_to_float(v);
  } else {
    return bf16_to_float(v);
  }
}

// The dtype's rounding of a float32 value, as float (identity for float32).
template <int DT>
DSPEC_DT_INLINE float round_to(float v) {
  if constexpr (DT == kFloat32) {
    return v;
  } else if constexpr (DT == kFloat16) {
    return half_to_float(float_to_half(v));
  } else {
    return bf16_to_float(float_to_bf16(v));
  }
}

template <int DT>
DSPEC_DT_INLINE float load(const void* base, std::int64_t idx) {
  return to_float<DT>(static_cast<const elem_t<DT>*>(base)[idx]);
}

// load<DT> with the dtype code known only at run time.
DSPEC_DT_INLINE float load(const void* base, int dtype, std::int64_t idx) {
  return dtype == kFloat32 ? load<kFloat32>(base, idx)
                           : (dtype == kFloat16 ? load<kFloat16>(base, idx) : load<kBFloat16>(base, idx));
}

template <int DT>
DSPEC_DT_INLINE void store(void* base, std::int64_t idx, float v) {
  if constexpr (DT == kFloat32) {
    static_cast<float*>(base)[idx] = v;
  } else if constexpr (DT == kFloat16) {
    static_cast<std::uint16_t*>(base)[idx] = float_to_half(v);
  } else {
    static_cast<std::uint16_t*>(base)[idx] = float_to_bf16(v);
  }
}

}  // namespace dt
}  // namespace dspec
