// The low-rank update of a mask-selective adapter at a forward's [MASK] rows, in place:
// y[r] += round(scale * B (A x[r])) for r in rows (A [rank, k], B [n, rank]; x, y in dtype,
// rounded as torch's `y.index_add(0, rows, delta.to(dtype))`).  One call replaces eight
// small torch ops per adapted projection of a decode step.
//
// float32 sums in a fixed order, so a row's bits never depend on the other rows or the
// threads: multiply-adds fused in the AVX-512 code, separate in the portable loops (the two
// differ in the last bits; isa auto takes AVX-512 where the CPU has it, so one process keeps
// one arithmetic).
#pragma once

#include <cstdint>

#include "dspec.h"
#include "linear.h"

namespace dspec {

struct MaskLoraArgs {
  int dtype = kFloat32;              // x and y
  std::int64_t num_rows = 0;         // entries of rows
  std::int64_t k = 0, n = 0, rank = 0;
  const std::int64_t* rows = nullptr;
  const void* x = nullptr;           // [*, k] contiguous
  int weight_dtype = kFloat32;       // a and bt: float32, or bfloat16 (widened exactly to float32)
  const void* a = nullptr;           // [rank, k]
  const void* bt = nullptr;          // B transposed: [rank, n]
  float scale = 1.0f;
  void* y = nullptr;                 // [*, n] contiguous
  int num_threads = 1;               // work split across threads (bits do not change)
  int isa = kLinearAuto;             // auto (AVX-512 where the CPU has it), generic or avx512
};

void mask_lora_cpu(const MaskLoraArgs& args);

// Whether mask_lora's AVX-512 code runs for this dtype on this CPU (float32, bfloat16).
bool mask_lora_has_avx512(int dtype);

}  // namespace dspec
