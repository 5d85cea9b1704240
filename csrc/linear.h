// A linear layer for the few rows of a decode or verification step on the CPU:
// out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]), weight in torch's nn.Linear layout
// packed once by linear_pack_cpu.
//
// With a handful of rows the layer is bound by streaming the weight from memory, and a
// library GEMM pays a setup cost per call that exceeds the math; from ~8 rows on it is
// bound by the multiply-adds.  The packed layout serves both: 16 output columns per
// vector register, so a row's step is one broadcast and a few fused multiply-adds
// (AVX512_BF16 dot products for bfloat16, FMA for float32), float32 accumulation, one
// rounding to the output dtype and no reduction across lanes.  On CPUs with AMX-BF16 the
// bfloat16 panels are AMX B operands as they are: 16 rows per tile multiply a panel's
// 32-deep k block in one instruction, so up to 16 rows cost about what one row costs.
//
// Batch invariance: every output element is reduced in the same order whatever m is and
// however the panels are split over threads, so a row's result does not depend on the
// other rows of the call (a verification forward of N tokens gives each token the bits a
// one-token step would).
#pragma once

#include <cstdint>

#include "dspec.h"

namespace dspec {

// auto: AMX for bfloat16 where the process may use it, else AVX-512 where the CPU has it
// (float32 / bfloat16), else AVX2 + FMA + F16C, else the portable loops; each capped by
// $DSPEC_CPU_ISA (cpu_features.h).
enum LinearIsa : int { kLinearAuto = 0, kLinearGeneric = 1, kLinearAvx512 = 2, kLinearAmx = 3, kLinearAvx2 = 4 };

// Output columns per panel of the packed weight.
constexpr int kPanel = 16;

// The packed weight: panel p = columns 16p .. 16p+15, S = 2 elements along k per column
// for 16-bit dtypes (pairs) and 1 for float32, zero padded past n and, for the 16-bit
// dtypes, to kp = k rounded up to a multiple of 32 (one AMX tile depth; kp = k for float32).
// Panels are grouped by 4 (the last group may hold fewer, tp): group g starts at element
// 4 g * linear_panel_elements and holds [kp / S][tp][16][S].
std::int64_t linear_panel_elements(std::int64_t k, int dtype);
std::int64_t linear_packed_elements(std::int64_t n, std::int64_t k, int dtype);

struct LinearPackArgs {
  int dtype = kFloat32;
  std::int64_t n = 0, k = 0, ldw = 0;  // weight [n, k], row stride ldw, unit stride along k
  const void* weight = nullptr;
  void* packed = nullptr;  // linear_packed_elements(n, k, dtype) elements
  int num_threads = 1;
};

void linear_pack_cpu(const LinearPackArgs& args);

struct LinearArgs {
  int dtype = kFloat32;              // x, weight, bias and out
  std::int64_t m = 0, k = 0, n = 0;  // x [m, k], weight [n, k] (packed), out [m, n]
  std::int64_t ldx = 0, ldo = 0;     // row strides in elements (unit stride along k / n)
  const void* x = nullptr;
  const void* weight = nullptr;  // packed by linear_pack_cpu for this n, k and dtype
  const void* bias = nullptr;    // [n] or null
  void* out = nullptr;
  int num_threads = 1;
  int isa = kLinearAuto;
};

void linear_cpu(const LinearArgs& args);

// The AVX-512 tiles' software prefetch distance along the packed weight, in k steps (each
// step of a tile of T panels reads T cache lines): steps >= 0 sets it and returns the old
// value; steps < 0 only returns it.  A tuning knob for machines whose memory latency or
// bandwidth differ from the one it was measured on; results never depend on it.
int linear_prefetch_steps(int steps);

// The AVX2 tiles' k chunk in steps for float32 weights or (sixteen_bit) the 16-bit dtypes'
// unwidened passes: steps >= 1 sets it and returns the old value; steps < 1 only returns it.
// A tuning knob like linear_prefetch_steps; results never depend on it (every output is
// one FMA chain in k order whatever the chunk).
int linear_avx2_chunk_steps(bool sixteen_bit, int steps);

// Several projections of the same x in one call (q / k / v, gate / up): parts[p] differ only
// in weight, bias, out, n and ldo; the panels of all parts are split over
// the threads together.  Each output is bit-identical to linear_cpu on that part alone.
void linear_group_cpu(const LinearArgs* parts, int count);

// Whether the AVX2 + FMA + F16C tiles may run (every dtype) on this CPU under the cap.
bool linear_has_avx2(int dtype);

// Whether the AVX-512 code runs for this dtype on this CPU (bfloat16 needs AVX512_BF16).
bool linear_has_avx512(int dtype);

// Whether the AMX tiles run for this dtype in this process (bfloat16 on a CPU with AMX-BF16
// whose kernel grants the tile state).
bool linear_has_amx(int dtype);

}  // namespace dspec
