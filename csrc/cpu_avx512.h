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
DSPEC_AVX512_INLINE __mmask16 lanes(std::int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// 16 elements of dtype DT from p (lanes outside m read as 0) as float32, exactly.
template <int DT>
DSPEC_AVX512_INLINE __m512 load_f32(const dt::elem_t<DT>* p, __mmask16 m) {
  if constexpr (DT == kFloat32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if constexpr (DT == kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
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
  const __m512 tc = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));   // NaN, -inf -> -126 -> 0 below
  if (clamped != nullptr) *clamped = tc;
  const __m512 n = _mm512_roundscale_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 q = exp2_poly16(_mm512_sub_ps(tc, n));           // f in [-0.5, 0.5], exact
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
  return _mm512_maskz_scalef_ps(normal, q, n);
}

}  // namespace cpu
}  // namespace dspec
#endif
#ifndef DSPEC_AVX512_CODE
#define DSPEC_AVX512_CODE 0
#endif
