// AVX-512 helpers shared by the CPU kernels whose vector code is written with intrinsics
// (cascade attention's tiles, mask_lora): the target attribute, lane masks, and the exact
// widening load of float32 / bfloat16 / float16 elements to float32.  Callers gate the code
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

}  // namespace cpu
}  // namespace dspec
#endif
#ifndef DSPEC_AVX512_CODE
#define DSPEC_AVX512_CODE 0
#endif
