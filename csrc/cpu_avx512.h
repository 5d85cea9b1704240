// AVX-512 helpers shared by the CPU kernels whose vector code is written with intrinsics
// (cascade attention's tiles, mask_lora, the logits scans): the target attribute, lane
// masks, the exact widening load of float32 / bfloat16 / float16 elements to float32, and
// a base-2 exp.  Callers gate the code
// on cpu::has_avx512() at run time, and compile it only where DSPEC_AVX512_CODE is 1.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define DSPEC_AVX512_CODE 1
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "dtype.h"

#define DSPEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define DSPEC_AVX512_INLINE DSPEC_AVX512 inline __attribute__((always_inline))

namespace dspec {
namespace cpu {

// How far ahead of its loads a scan streaming a logits row from memory prefetches, in
// bytes: the hardware prefetchers alone left one stream per core at ~6 GB/s on this
// project's KVM Xeon.  token_stats' argmax pass over 1088 x 49152 fp32 (2 threads, Nov
// 2026): 16.0 ms without, 10.5 / 8.8 / 8.2 / 7.7 / 8.2 ms at 1 / 2 / 4 / 8 / 16 KiB.
constexpr int kStreamAhead = 4096;

// The first min(n, 16) lanes (n >= 0).
DSPEC_AVX512_INLINE __mmask16 lanes(std::int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// 16 elements of dtype DT from p (lanes outside m read as 0) as float32, exactly.
template <int DT>
DSPEC_AVX512_INLINE __m512 load_f32(const dt::elem_t<DT>* p, __mmask16 m) {
  if constexpr (DT == kFloat32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if constexpr (DT == kBFloat16) {
      // element i into the high half of 32-bit lane i, the low half 0: one word permute
      // (where a zero extension and a shift took two operations)
      const __m512i to_high = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0,
                                               4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
      return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, to_high, _mm512_castsi256_si512(h)));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// dt::float_to_bf16 on 16 lanes, as 32-bit lanes holding the 16-bit results: round to
// nearest even on the integer bits, a NaN stays a quiet NaN (the AVX512_BF16 conversion
// would flush subnormals, so it is not used where bits must match the scalar code).
DSPEC_AVX512_INLINE __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))),
                        16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
}

// 2^f on 16 lanes for f in [-0.5, 0.5]: Cephes' exp2f polynomial (about 1 ulp), as fused
// multiply-adds.
DSPEC_AVX512_INLINE __m512 exp2_poly16(__m512 f) {
  __m512 q = _mm512_set1_ps(1.535336188319500e-4f);
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.339887440266574e-3f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(9.618437357674640e-3f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(5.550332471162809e-2f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(2.402264791363012e-1f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(6.931472028550421e-1f));
  return _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
}

// 2^t on 16 lanes for t <= 0 (-inf and NaN give 0): exp2_nonpos' algorithm (cpu_math.h)
// with fused multiply-adds and 2^n by vscalefps; 0 at and below 2^-126, so that no
// subnormal reaches a sum (subnormal operands cost microcode assists).
// `clamped` (when given) receives max(t, -126), NaN as -126: finite wherever the result is 0.
DSPEC_AVX512_INLINE __m512 exp2_nonpos16(__m512 t, __m512* clamped = nullptr) {
  const __m512 tc = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));  // NaN, -inf -> -126 -> 0 below
  if (clamped != nullptr) *clamped = tc;
  const __m512 n = _mm512_roundscale_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 q = exp2_poly16(_mm512_sub_ps(tc, n));  // f in [-0.5, 0.5], exact
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
  return _mm512_maskz_scalef_ps(normal, q, n);
}

// Sortable integer keys of IEEE values (AVX512BW): key = bits ^ ((bits >> (w - 1)) & 0x7f..f)
// orders like the values as a signed w-bit integer (-0 just below +0; a NaN above +inf or
// below -inf), so a max / min over many elements is an integer max / min on 512 / w lanes
// (32 for the 16-bit dtypes) and a NaN shows as a key beyond +-inf.  The map is its own
// inverse.
template <int DT>
struct Keys {
  static constexpr bool kWide = DT == kFloat32;  // 32-bit lanes, else 16-bit
  static constexpr int kPer = kWide ? 16 : 32;   // elements per vector
  using Mask = std::conditional_t<kWide, __mmask16, __mmask32>;
  static constexpr std::int64_t kPosInf = DT == kFloat32 ? 0x7f800000 : DT == kBFloat16 ? 0x7f80 : 0x7c00;
  static constexpr std::int64_t kNegInfKey =  // the key of -inf, as a signed lane
      DT == kFloat32 ? 0x807fffff - (std::int64_t(1) << 32) : (DT == kBFloat16 ? 0x807f : 0x83ff) - 0x10000;

  DSPEC_AVX512_INLINE static __m512i key(__m512i v) {
    if constexpr (kWide) {
      return _mm512_ternarylogic_epi32(v, _mm512_srai_epi32(v, 31), _mm512_set1_epi32(0x7fffffff), 0x78);
    } else {
      return _mm512_ternarylogic_epi32(v, _mm512_srai_epi16(v, 15), _mm512_set1_epi16(0x7fff), 0x78);
    }
  }
  // the first min(n, kPer) lanes (n >= 0), as the masked operations below take them
  DSPEC_AVX512_INLINE static std::uint64_t first(std::int64_t n) {
    return n >= kPer ? (std::uint64_t(1) << kPer) - 1 : (std::uint64_t(1) << n) - 1;
  }
  DSPEC_AVX512_INLINE static __m512i set1(std::int64_t k) {
    if constexpr (kWide)
      return _mm512_set1_epi32(static_cast<std::int32_t>(k));
    else
      return _mm512_set1_epi16(static_cast<std::int16_t>(k));
  }
  DSPEC_AVX512_INLINE static __m512i load(const void* p, std::uint64_t m) {
    if constexpr (kWide)
      return _mm512_maskz_loadu_epi32(static_cast<Mask>(m), p);
    else
      return _mm512_maskz_loadu_epi16(static_cast<Mask>(m), p);
  }
  DSPEC_AVX512_INLINE static __m512i max(__m512i a, __m512i b) {
    if constexpr (kWide)
      return _mm512_max_epi32(a, b);
    else
      return _mm512_max_epi16(a, b);
  }
  DSPEC_AVX512_INLINE static __m512i min(__m512i a, __m512i b) {
    if constexpr (kWide)
      return _mm512_min_epi32(a, b);
    else
      return _mm512_min_epi16(a, b);
  }
  // lanes outside m keep s
  DSPEC_AVX512_INLINE static __m512i mask_max(__m512i s, std::uint64_t m, __m512i a, __m512i b) {
    if constexpr (kWide)
      return _mm512_mask_max_epi32(s, static_cast<Mask>(m), a, b);
    else
      return _mm512_mask_max_epi16(s, static_cast<Mask>(m), a, b);
  }
  DSPEC_AVX512_INLINE static __m512i mask_min(__m512i s, std::uint64_t m, __m512i a, __m512i b) {
    if constexpr (kWide)
      return _mm512_mask_min_epi32(s, static_cast<Mask>(m), a, b);
    else
      return _mm512_mask_min_epi16(s, static_cast<Mask>(m), a, b);
  }
  DSPEC_AVX512_INLINE static std::uint64_t eq(__m512i a, __m512i b) {
    if constexpr (kWide)
      return _mm512_cmpeq_epi32_mask(a, b);
    else
      return _mm512_cmpeq_epi16_mask(a, b);
  }
  DSPEC_AVX512_INLINE static std::uint64_t gt(__m512i a, __m512i b) {
    if constexpr (kWide)
      return _mm512_cmpgt_epi32_mask(a, b);
    else
      return _mm512_cmpgt_epi16_mask(a, b);
  }
  DSPEC_AVX512_INLINE static std::uint64_t zero(__m512i a) {  // the lanes holding +0 or -0
    if constexpr (kWide)
      return _mm512_testn_epi32_mask(a, _mm512_set1_epi32(0x7fffffff));
    else
      return _mm512_testn_epi16_mask(a, _mm512_set1_epi16(0x7fff));
  }
};

// A key back to its value.
template <int DT>
inline float key_value(std::int64_t key) {
  if constexpr (DT == kFloat32) {
    const std::uint32_t k = static_cast<std::uint32_t>(key);
    return dt::f32_from_bits(k ^ (k >> 31 ? 0x7fffffffu : 0u));
  } else {
    const std::uint16_t k = static_cast<std::uint16_t>(key);
    return dt::to_float<DT>(static_cast<std::uint16_t>(k ^ (k >> 15 ? 0x7fffu : 0u)));
  }
}

// The key of a value of dtype DT held as a float (exactly representable in DT).
template <int DT>
inline std::int64_t value_key(float v) {
  if constexpr (DT == kFloat32) {
    const std::uint32_t b = dt::bits_from_f32(v);
    return static_cast<std::int32_t>(b ^ (b >> 31 ? 0x7fffffffu : 0u));
  } else {
    const std::uint16_t b =
        DT == kBFloat16 ? static_cast<std::uint16_t>(dt::bits_from_f32(v) >> 16) : dt::float_to_half(v);
    return static_cast<std::int16_t>(b ^ (b >> 15 ? 0x7fffu : 0u));
  }
}

}  // namespace cpu
}  // namespace dspec
#endif
#ifndef DSPEC_AVX512_CODE
#define DSPEC_AVX512_CODE 0
#endif
