// What the running CPU can execute, checked once: the AVX-512 subsets the vectorised CPU
// code is compiled for (target attributes, chosen at run time).
#pragma once

namespace dspec {
namespace cpu {

// AVX512F / BW / VL and FMA: the AVX-512 tiles of cascade_attention and linear.
inline bool has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

// has_avx512() plus AVX512_BF16 (bfloat16 dot products: linear's bf16 tiles).
inline bool has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

}  // namespace cpu
}  // namespace dspec
