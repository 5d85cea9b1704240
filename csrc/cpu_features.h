// What the running CPU can execute, checked once: the AVX-512 subsets the vectorised CPU
// code is compiled for (target attributes, chosen at run time).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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
inline bool has_amx_bf16() {
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
  static const bool yes = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // CPUID.(7, 0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE
    if (!has_avx512_bf16() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if ((edx >> 22 & 1u) == 0 || (edx >> 24 & 1u) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return yes;
#else
  return false;
#endif
}

}  // namespace cpu
}  // namespace dspec
