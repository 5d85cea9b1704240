// The low-rank update of a mask-selective adapter at a forward's [MASK] rows, in place:
// y[r] += round(scale * B (A x[r])) for r in rows (A [rank, k], B [n, rank]; x, y in dtype,
// rounded as torch's `y.index_add(0, rows, delta.to(dtype))`).  One call replaces eight
// small torch ops per adapted projection of a decode step.
//
// float32 sums in a fixed order, so a row's bits never depend on the other rows or the
// threads: multiply-adds fused in the AVX-512 code, separate in the portable loops (the two
// differ in the last bits; isa auto takes AVX-512 where the CPU has it, so one process keeps
// one arithmetic).
//
// With AMX-BF16, bfloat16 x and y, and the adapter packed once by mask_lora_pack (bf16 values,
// rank <= 16), the update runs on the tile unit instead: h = A x[r] in tile products (exact bf16
// products, float32 sums), h split into bf16 hi + lo parts (h to ~16 bits; the update's last
// rounding is bf16's 8), then B (hi + lo) in tile products.  Its bits are not the AVX-512 code's;
// a row's bits still depend on that row alone.
#pragma once

#include <cstdint>

#include "dspec.h"
#include "linear.h"

namespace dspec {

struct MaskLoraArgs {
  int dtype = kFloat32;       // x and y
  std::int64_t num_rows = 0;  // entries of rows
  std::int64_t k = 0, n = 0, rank = 0;
  const std::int64_t* rows = nullptr;
  const void* x = nullptr;      // [*, k] contiguous
  int weight_dtype = kFloat32;  // a and bt: float32, or bfloat16 (widened exactly to float32)
  const void* a = nullptr;      // [rank, k]
  const void* bt = nullptr;     // B transposed: [rank, n]
  float scale = 1.0f;
  void* y = nullptr;             // [*, n] contiguous
  int num_threads = 1;           // work split across threads (bits do not change)
  int isa = kLinearAuto;         // auto (AMX with `packed`, else AVX-512 where the CPU has them), generic, avx512, amx
  const void* packed = nullptr;  // bf16, mask_lora_pack's layout of a and bt, or null
};

void mask_lora_cpu(const MaskLoraArgs& args);

// Whether mask_lora's AVX-512 code runs for this dtype on this CPU (float32, bfloat16).
bool mask_lora_has_avx512(int dtype);

// Whether the AMX code can run: this CPU has AMX-BF16, dtype bfloat16, rank <= kMaskLoraAmxRank.
bool mask_lora_has_amx(int dtype, std::int64_t rank);

constexpr std::int64_t kMaskLoraAmxRank = 16;

// The packed adapter the AMX code reads (bf16 elements): A as the stage-1 B operand, k in pairs
// ([kp / 32][16 k pairs][16 ranks][2], kp = k rounded up to 32), then B^T as the stage-2 one
// ([np / 16][8 rank pairs][16 outputs][2], np = n rounded up to 16), zero padded (ranks to 16).
std::int64_t mask_lora_packed_size(std::int64_t k, std::int64_t n);
void mask_lora_pack_cpu(const void* a, const void* bt, int weight_dtype, std::int64_t rank, std::int64_t k,
                        std::int64_t n, std::uint16_t* packed);

}  // namespace dspec
