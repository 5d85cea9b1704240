// AMX-BF16 tile configuration shared by the CPU kernels that use the tile unit (linear's
// bf16 panels, cascade_attention's bf16 tiles).  Every configured tile has 64-byte rows
// (16 float32 or 32 bf16); the first `row_tiles` tiles have `rows` rows (accumulators and
// A operands: one row per row of the problem), the rest 16 (B operands: 16 k pairs).
// A kernel loads its configuration at the start of each call and releases the tiles at
// the end: other code on the same thread (oneDNN's AMX kernels) configures them its own way.
#pragma once

// The AMX code needs a compiler that knows the AMX target attributes and intrinsics (GCC 11,
// clang 12); with an older one, or with DSPEC_NO_AMX defined, it is left out and the
// AVX-512 code runs instead.
#if !defined(DSPEC_NO_AMX) && defined(__x86_64__) && defined(__GNUC__) && \
    ((!defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#define DSPEC_AMX_CODE 1
#else
#define DSPEC_AMX_CODE 0
#endif

#if DSPEC_AMX_CODE
#include <immintrin.h>

#include <atomic>
#include <cstdint>

#define DSPEC_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma,avx512bf16,amx-tile,amx-bf16")))

namespace dspec {
namespace cpu {

constexpr int kAmxMaxRows = 16;  // rows of a tile
constexpr int kAmxRowBytes = 64;

struct alignas(64) AmxConfig {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

DSPEC_AMX_TARGET inline void amx_configure(int rows, int row_tiles) {
  AmxConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<std::uint8_t>(t < row_tiles ? rows : kAmxMaxRows);
    c.colsb[t] = kAmxRowBytes;
  }
  // the intrinsic's asm names only the config's first bytes as an input
  std::atomic_signal_fence(std::memory_order_seq_cst);
  _tile_loadconfig(&c);
}

}  // namespace cpu
}  // namespace dspec
#endif
