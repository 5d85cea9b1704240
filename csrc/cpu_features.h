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

// AMX-BF16 tiles usable by this process: the CPU has AMX-TILE and AMX-BF16, and Linux granted
// the process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once; the grant
// covers every thread of the process, a kernel without it refuses and AMX stays off).
bool has_amx_bf16();

}  // namespace cpu
}  // namespace dspec
