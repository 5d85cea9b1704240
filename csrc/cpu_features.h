// What the running CPU can execute, checked once, and the instruction-set cap
// ($DSPEC_CPU_ISA, like oneDNN's ONEDNN_MAX_CPU_ISA) every C++ kernel obeys: the AVX2 and
// AVX-512 code paths (target attributes, chosen at run time) and the AMX tiles run only
// where the CPU has them and the cap allows them.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dspec {
namespace cpu {

// The instruction-set levels, lowest first: portable loops, AVX2 + FMA + F16C (x86-64-v3),
// AVX-512 F/BW/VL (+ AVX512_BF16 where the CPU has it), AMX-BF16 tiles.
enum IsaLevel : int { kLevelGeneric = 0, kLevelAvx2 = 1, kLevelAvx512 = 2, kLevelAmx = 3 };

// $DSPEC_CPU_ISA as a level: generic / avx2 / avx512 / amx (any case); unset, empty or "auto" is no cap
// (amx); anything else is also no cap here (dspec's Python layer refuses it with a ValueError
// before the extension loads).
inline int isa_cap_from_env() {
  const char* v = std::getenv("DSPEC_CPU_ISA");
  if (v == nullptr) return kLevelAmx;
  char low[16] = {};
  for (int i = 0; i < 15 && v[i] != '\0'; ++i) low[i] = (v[i] >= 'A' && v[i] <= 'Z') ? char(v[i] - 'A' + 'a') : v[i];
  if (std::strcmp(low, "generic") == 0) return kLevelGeneric;
  if (std::strcmp(low, "avx2") == 0) return kLevelAvx2;
  if (std::strcmp(low, "avx512") == 0) return kLevelAvx512;
  return kLevelAmx;
}

inline std::atomic<int>& isa_cap_storage() {
  static std::atomic<int> cap{isa_cap_from_env()};
  return cap;
}

// The cap now (set_isa_cap changes it for the process: the tests run every level in one run).
inline int isa_cap() { return isa_cap_storage().load(std::memory_order_relaxed); }
inline void set_isa_cap(int level) {
  isa_cap_storage().store(level < kLevelGeneric ? kLevelGeneric : (level > kLevelAmx ? kLevelAmx : level),
                          std::memory_order_relaxed);
}

// The CPU has AVX2, FMA and F16C (every x86-64-v3 part: Haswell and later, every Zen).
inline bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  return yes;
#else
  return false;
#endif
}

// The CPU has AVX512F / BW / VL / DQ / CD and FMA (x86-64-v4).
inline bool cpu_has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512cd");
  return yes;
#else
  return false;
#endif
}

// The highest level this CPU has (the cap aside).
inline int cpu_level() {
  static const int level = [] {
    if (!cpu_has_avx2()) return int(kLevelGeneric);
    if (!cpu_has_avx512()) return int(kLevelAvx2);
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // CPUID.(7, 0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 22 & 1u) && (edx >> 24 & 1u)) return int(kLevelAmx);
#endif
    return int(kLevelAvx512);
  }();
  return level;
}

// The level the kernels run at: the CPU's, capped.
inline int isa_level() {
  const int cpu = cpu_level();
  const int cap = isa_cap();
  return cpu < cap ? cpu : cap;
}

// AVX2 + FMA + F16C code may run (the CPU has it and the cap allows it).
inline bool has_avx2() { return cpu_has_avx2() && isa_cap() >= kLevelAvx2; }

// AVX512F/BW/VL and FMA: the AVX-512 tiles of cascade_attention and linear.
inline bool has_avx512() { return cpu_has_avx512() && isa_cap() >= kLevelAvx512; }

// has_avx512() plus AVX512_BF16 (bfloat16 dot products: linear's bf16 tiles).
inline bool has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool cpu = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return cpu && has_avx512();
#else
  return false;
#endif
}

// AMX-BF16 tiles usable by this process: the CPU has AMX-TILE and AMX-BF16, Linux granted
// the process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once; the grant
// covers every thread of the process, a kernel without it refuses and AMX stays off), and
// the cap allows it.
inline bool has_amx_bf16() {
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
  static const bool granted = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!cpu_has_avx512() || !__builtin_cpu_supports("avx512bf16")) return false;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if ((edx >> 22 & 1u) == 0 || (edx >> 24 & 1u) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted && isa_cap() >= kLevelAmx;
#else
  return false;
#endif
}

}  // namespace cpu
}  // namespace dspec
