// The mask-selective adapter's update at the [MASK] rows on the CPU; see mask_lora.h.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_avx512.h"
#include "cpu_features.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "dtype.h"
#include "mask_lora.h"

namespace dspec {
namespace {

// The [MASK] rows' low-rank update in float32, nothing reassociated per call: h[r] = A[r] . x
// as 16-lane partial sums along k (lane l takes k = l, l + 16, ...) folded by a fixed lane
// tree 8 / 4 / 2 / 1, then every output as h[r] * B^T[r][o] accumulated over r in order,
// y + round(scale * sum) in y's dtype.  A row's bits depend only on that row (not on which or
// how many rows are masked, nor on the threads).  A and B^T may be kept in bfloat16 (WT): an
// adapter whose values are bf16 (the shipped one is stored so) streams half the bytes and
// gives the same bits (the widening is exact).
//
// The portable loops multiply and add (the auto-vectoriser fuses nothing with contraction
// off, and does not vectorise std::fma's lane loops: fused, they ran 10x slower); the
// AVX-512 code below fuses each multiply-add, so the two differ in the last bits.
constexpr int kLoraLanes = 16;

template <int WT>
DSPEC_CPU_INLINE float lane_dot(const dt::elem_t<WT>* a, const float* b, std::int64_t len) {
  float acc[kLoraLanes] = {};
  std::int64_t i = 0;
  for (; i + kLoraLanes <= len; i += kLoraLanes)
    for (int l = 0; l < kLoraLanes; ++l) acc[l] += dt::to_float<WT>(a[i + l]) * b[i + l];
  for (int l = 0; i + l < len; ++l) acc[l] += dt::to_float<WT>(a[i + l]) * b[i + l];
  for (int width = kLoraLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}

template <int DT, int WT>
DSPEC_CPU_INLINE void mask_lora_rows(const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1) {
  using E = dt::elem_t<DT>;
  using W = dt::elem_t<WT>;
  const E* x = static_cast<const E*>(a.x);
  const W* wa = static_cast<const W*>(a.a);
  const W* wbt = static_cast<const W*>(a.bt);
  E* y = static_cast<E*>(a.y);
  thread_local std::vector<float> xf, h;
  xf.resize(static_cast<std::size_t>(a.k));
  h.resize(static_cast<std::size_t>(a.rank));
  const std::int64_t full = a.n / kLoraLanes * kLoraLanes;
  for (std::int64_t i = r0; i < r1; ++i) {
    const std::int64_t row = a.rows[i];
    const E* xr = x + row * a.k;
    for (std::int64_t c = 0; c < a.k; ++c) xf[c] = dt::to_float<DT>(xr[c]);
    for (std::int64_t r = 0; r < a.rank; ++r) h[r] = lane_dot<WT>(wa + r * a.k, xf.data(), a.k);
    E* yr = y + row * a.n;
    for (std::int64_t o = 0; o < full; o += kLoraLanes) {
      float acc[kLoraLanes] = {};
      for (std::int64_t r = 0; r < a.rank; ++r) {
        const float hr = h[r];
        const W* bt = wbt + r * a.n + o;
        for (int l = 0; l < kLoraLanes; ++l) acc[l] += hr * dt::to_float<WT>(bt[l]);
      }
      // delta.to(dtype), then the dtype's add
      for (int l = 0; l < kLoraLanes; ++l)
        dt::store<DT>(yr, o + l, dt::to_float<DT>(yr[o + l]) + dt::round_to<DT>(acc[l] * a.scale));
    }
    for (std::int64_t o = full; o < a.n; ++o) {
      float acc = 0.0f;
      for (std::int64_t r = 0; r < a.rank; ++r) acc += h[r] * dt::to_float<WT>(wbt[r * a.n + o]);
      dt::store<DT>(yr, o, dt::to_float<DT>(yr[o]) + dt::round_to<DT>(acc * a.scale));
    }
  }
}

#if DSPEC_AVX512_CODE
// The same update in the same order with AVX-512 FMAs (one rounding per multiply-add: not the
// portable loops' bits), as a small GEMM over blocks of up to kLoraRows rows: one load of an
// A row or a B^T vector serves every row of the block.  (The per-row code it replaced re-read
// A for each row and multiplied and added separately: 12.7 us per row and layer of SmolLM2's
// seven projections on one thread, against 5.4 here, ~93 % of this AMX Xeon's measured
// 512-bit FMA rate.)
// The dtype's round-to-nearest-even is done on the integer bits as dt::float_to_bf16 does
// (the AVX512_BF16 conversion would flush subnormals).
constexpr int kLoraRows = 8;

template <int DT>
DSPEC_AVX512 inline __m512 lora_round(__m512 v) {
  if constexpr (DT == kFloat32) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(cpu::bf16_bits(v), 16));
  }
}

template <int DT>
DSPEC_AVX512 inline void lora_store(dt::elem_t<DT>* p, __m512 v, __mmask16 m) {
  if constexpr (DT == kFloat32) {
    _mm512_mask_storeu_ps(p, m, v);
  } else {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(cpu::bf16_bits(v)));
  }
}

// lane_dot's fold 8 / 4 / 2 / 1 of one vector of partial sums.
DSPEC_AVX512_INLINE float lora_fold(__m512 v) {
  const __m256 s8 =
      _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// h[j][r0 .. r0 + C) of NR rows (xf: the rows in float32, kp apart, zero padded to whole
// 16-lane chunks): NR x C vectors of partial sums in registers over one pass along k.
template <int NR, int C, int WT>
DSPEC_AVX512_INLINE void lora_h_ranks(const MaskLoraArgs& a, std::int64_t r0, const float* xf, std::int64_t kp,
                                      float* h) {
  const auto* wa = static_cast<const dt::elem_t<WT>*>(a.a) + r0 * a.k;
  __m512 acc[NR][C];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < kp; i += kLoraLanes) {
    const __mmask16 m = cpu::lanes(a.k - i);
    __m512 av[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) av[c] = cpu::load_f32<WT>(wa + c * a.k + i, m);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const __m512 xv = _mm512_loadu_ps(xf + j * kp + i);
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(av[c], xv, acc[j][c]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < C; ++c) h[j * a.rank + r0 + c] = lora_fold(acc[j][c]);
}

// The update of NR rows: x to float32 once (xf: kp floats a row, k rounded up to whole
// 16-lane chunks), h two ranks per pass, then 32 outputs per pass
// over B^T with NR x 2 vector sums in registers.
template <int NR, int DT, int WT>
DSPEC_AVX512 void lora_block(const MaskLoraArgs& a, const std::int64_t* rows, std::int64_t kp, float* xf, float* h) {
  using E = dt::elem_t<DT>;
  const E* x = static_cast<const E*>(a.x);
  const auto* wbt = static_cast<const dt::elem_t<WT>*>(a.bt);
  E* y = static_cast<E*>(a.y);
  for (int j = 0; j < NR; ++j) {
    const E* xr = x + rows[j] * a.k;
    for (std::int64_t i = 0; i < kp; i += kLoraLanes)
      _mm512_storeu_ps(xf + j * kp + i, cpu::load_f32<DT>(xr + i, cpu::lanes(a.k - i)));
  }
  std::int64_t r = 0;
  for (; r + 2 <= a.rank; r += 2) lora_h_ranks<NR, 2, WT>(a, r, xf, kp, h);
  if (r < a.rank) lora_h_ranks<NR, 1, WT>(a, r, xf, kp, h);
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (std::int64_t o = 0; o < a.n; o += 2 * kLoraLanes) {
    const __mmask16 m[2] = {cpu::lanes(a.n - o), cpu::lanes(std::max<std::int64_t>(0, a.n - o - kLoraLanes))};
    __m512 acc[NR][2];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (std::int64_t q = 0; q < a.rank; ++q) {
      const __m512 b0 = cpu::load_f32<WT>(wbt + q * a.n + o, m[0]);
      const __m512 b1 = cpu::load_f32<WT>(wbt + q * a.n + o + kLoraLanes, m[1]);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const __m512 hv = _mm512_set1_ps(h[j * a.rank + q]);
        acc[j][0] = _mm512_fmadd_ps(hv, b0, acc[j][0]);
        acc[j][1] = _mm512_fmadd_ps(hv, b1, acc[j][1]);
      }
    }
    // delta.to(dtype), then the dtype's add
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      E* yr = y + rows[j] * a.n + o;
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        const __m512 delta = lora_round<DT>(_mm512_mul_ps(acc[j][c], scale));
        lora_store<DT>(yr + c * kLoraLanes, _mm512_add_ps(cpu::load_f32<DT>(yr + c * kLoraLanes, m[c]), delta), m[c]);
      }
    }
  }
}

template <int DT, int WT>
DSPEC_AVX512 void mask_lora_rows_avx512(const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1) {
  const std::int64_t kp = (a.k + kLoraLanes - 1) / kLoraLanes * kLoraLanes;
  thread_local std::vector<float> xf, h;
  xf.resize(static_cast<std::size_t>(kLoraRows * kp));
  h.resize(static_cast<std::size_t>(kLoraRows * a.rank));
  for (std::int64_t i = r0; i < r1; i += kLoraRows) {
    const std::int64_t* rows = a.rows + i;
    switch (std::min<std::int64_t>(kLoraRows, r1 - i)) {
      case 1: lora_block<1, DT, WT>(a, rows, kp, xf.data(), h.data()); break;
      case 2: lora_block<2, DT, WT>(a, rows, kp, xf.data(), h.data()); break;
      case 3: lora_block<3, DT, WT>(a, rows, kp, xf.data(), h.data()); break;
      case 4: lora_block<4, DT, WT>(a, rows, kp, xf.data(), h.data()); break;
      case 5: lora_block<5, DT, WT>(a, rows, kp, xf.data(), h.data()); break;
      case 6: lora_block<6, DT, WT>(a, rows, kp, xf.data(), h.data()); break;
      case 7: lora_block<7, DT, WT>(a, rows, kp, xf.data(), h.data()); break;
      default: lora_block<8, DT, WT>(a, rows, kp, xf.data(), h.data()); break;
    }
  }
}
#endif

#if DSPEC_AMX_CODE
// The AMX update of up to 16 rows at a time (see mask_lora.h).  Tiles, 16-k operands:
// stage 1 accumulates h [16 rows][16 ranks] in 0 and 3 (even / odd 16-k halves of each 32),
// the rows' x in 4 / 5, the packed A in 6 / 7 [8 k pairs][16 ranks][2]; stage 2 holds h's
// bf16 hi / lo parts [16 rows][16 ranks] in 4 / 5 and accumulates [16 rows][16 outputs] in 3
// and 0 in turn from the packed B^T blocks in 6 / 7 [8 rank pairs][16 outputs][2].  (1 and 2
// are unused.)
constexpr int kLoraTile = 16;
constexpr std::int64_t kLoraDepth = 32;                             // k per stage-1 tile product
constexpr std::int64_t kLoraBBlock = kMaskLoraAmxRank * kLoraTile;  // bf16 of one packed B^T block

DSPEC_AMX_TARGET inline void lora_amx_configure() {
  cpu::AmxConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = t >= 6 ? kLoraTile / 2 : kLoraTile;
    c.colsb[t] = t == 4 || t == 5 ? kLoraTile * 2 : cpu::kAmxRowBytes;
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  _tile_loadconfig(&c);
}

// Accumulator tile C = h (hi, tile 4, and lo, tile 5) times the packed B^T block at PB (into
// tile B).  (The tile intrinsics take literal tile numbers.)
#define DSPEC_LORA_AMX_BLOCK(C, B, PB)       \
  do {                                       \
    _tile_zero(C);                           \
    _tile_loadd(B, (PB), cpu::kAmxRowBytes); \
    _tile_dpbf16ps(C, 4, B);                 \
    _tile_dpbf16ps(C, 5, B);                 \
  } while (0)

// Rows [i0, i0 + mr) of the call (mr <= 16): x gathered into xg (16 x kp, each row's k tail
// zeroed), h = x A^T on tiles, its hi / lo bf16 split, then each block of 16 outputs.
DSPEC_AMX_TARGET void lora_amx_rows(const MaskLoraArgs& a, std::int64_t i0, int mr, std::int64_t kp,
                                    std::uint16_t* xg) {
  const auto* x = static_cast<const std::uint16_t*>(a.x);
  auto* y = static_cast<std::uint16_t*>(a.y);
  const auto* pa = static_cast<const std::uint16_t*>(a.packed);
  const std::uint16_t* pb = pa + kp * kMaskLoraAmxRank;
  // rows past mr keep whatever they held: a tile row's products never reach another row
  for (int j = 0; j < mr; ++j) {
    std::memcpy(xg + j * kp, x + a.rows[i0 + j] * a.k, static_cast<std::size_t>(a.k) * 2);
    std::memset(xg + j * kp + a.k, 0, static_cast<std::size_t>(kp - a.k) * 2);
  }
  alignas(64) float acc[kLoraTile][kLoraTile];
  alignas(64) std::uint16_t hi[kLoraTile][kLoraTile], lo[kLoraTile][kLoraTile];
  std::atomic_signal_fence(std::memory_order_seq_cst);  // tile loads are asm the compiler cannot see through
  // h in two chains of 16-k tile products (even k halves into tile 0, odd into tile 3, the
  // operands in tiles 4 / 6 and 5 / 7), summed once: a chain of dependent products waits
  // for each one's latency
  _tile_zero(0);
  _tile_zero(3);
  for (std::int64_t d = 0; d < kp / kLoraDepth; ++d) {
    const std::uint16_t* xd = xg + d * kLoraDepth;
    const std::uint16_t* ad = pa + d * kLoraDepth * kLoraTile;
    _tile_loadd(4, xd, kp * 2);
    _tile_loadd(6, ad, cpu::kAmxRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, xd + kLoraDepth / 2, kp * 2);
    _tile_loadd(7, ad + kLoraDepth / 2 * kLoraTile, cpu::kAmxRowBytes);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float odd[kLoraTile][kLoraTile];
  _tile_stored(0, &acc[0][0], cpu::kAmxRowBytes);
  _tile_stored(3, &odd[0][0], cpu::kAmxRowBytes);
  for (int j = 0; j < kLoraTile; ++j) {
    const __m512 h = _mm512_add_ps(_mm512_load_ps(acc[j]), _mm512_load_ps(odd[j]));
    const __m512i h_hi = cpu::bf16_bits(h);
    const __m512 rest = _mm512_sub_ps(h, _mm512_castsi512_ps(_mm512_slli_epi32(h_hi, 16)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(hi[j]), _mm512_cvtepi32_epi16(h_hi));
    _mm256_store_si256(reinterpret_cast<__m256i*>(lo[j]), _mm512_cvtepi32_epi16(cpu::bf16_bits(rest)));
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  _tile_loadd(4, &hi[0][0], kLoraTile * 2);
  _tile_loadd(5, &lo[0][0], kLoraTile * 2);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const std::int64_t blocks = (a.n + kLoraTile - 1) / kLoraTile;
  // two accumulators (3, 0) and B operands (6, 7) in turn: block b + 1's tile products run
  // while block b is stored and added to y
  DSPEC_LORA_AMX_BLOCK(3, 6, pb);
  for (std::int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) {
      if (b % 2 == 0) {
        DSPEC_LORA_AMX_BLOCK(0, 7, pb + (b + 1) * kLoraBBlock);
      } else {
        DSPEC_LORA_AMX_BLOCK(3, 6, pb + (b + 1) * kLoraBBlock);
      }
    }
    if (b % 2 == 0) {
      _tile_stored(3, &acc[0][0], cpu::kAmxRowBytes);
    } else {
      _tile_stored(0, &acc[0][0], cpu::kAmxRowBytes);
    }
    const std::int64_t o = b * kLoraTile;
    const __mmask16 m = cpu::lanes(a.n - o);
    for (int j = 0; j < mr; ++j) {  // delta.to(bf16), then bf16's add
      std::uint16_t* yr = y + a.rows[i0 + j] * a.n + o;
      const __m512 delta = lora_round<kBFloat16>(_mm512_mul_ps(_mm512_load_ps(acc[j]), scale));
      lora_store<kBFloat16>(yr, _mm512_add_ps(cpu::load_f32<kBFloat16>(yr, m), delta), m);
    }
  }
}

DSPEC_AMX_TARGET void mask_lora_rows_amx(const MaskLoraArgs& a, std::int64_t g0, std::int64_t g1) {
  const std::int64_t kp = (a.k + kLoraDepth - 1) / kLoraDepth * kLoraDepth;
  thread_local std::vector<std::uint16_t> xg;
  if (xg.size() < static_cast<std::size_t>(kLoraTile * kp)) xg.resize(static_cast<std::size_t>(kLoraTile * kp));
  lora_amx_configure();
  for (std::int64_t g = g0; g < g1; ++g) {
    const std::int64_t i0 = g * kLoraTile;
    lora_amx_rows(a, i0, static_cast<int>(std::min<std::int64_t>(kLoraTile, a.num_rows - i0)), kp, xg.data());
  }
  _tile_release();
}
#endif

DSPEC_CPU_MULTI(void, mask_lora_f32, (const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1), (a, r0, r1)) {
  mask_lora_rows<kFloat32, kFloat32>(a, r0, r1);
}
DSPEC_CPU_MULTI(void, mask_lora_f16, (const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1), (a, r0, r1)) {
  mask_lora_rows<kFloat16, kFloat32>(a, r0, r1);
}
DSPEC_CPU_MULTI(void, mask_lora_bf16, (const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1), (a, r0, r1)) {
  mask_lora_rows<kBFloat16, kFloat32>(a, r0, r1);
}
DSPEC_CPU_MULTI(void, mask_lora_f32_w16, (const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1), (a, r0, r1)) {
  mask_lora_rows<kFloat32, kBFloat16>(a, r0, r1);
}
DSPEC_CPU_MULTI(void, mask_lora_f16_w16, (const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1), (a, r0, r1)) {
  mask_lora_rows<kFloat16, kBFloat16>(a, r0, r1);
}
DSPEC_CPU_MULTI(void, mask_lora_bf16_w16, (const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1), (a, r0, r1)) {
  mask_lora_rows<kBFloat16, kBFloat16>(a, r0, r1);
}

}  // namespace

bool mask_lora_has_avx512(int dtype) {
#if DSPEC_AVX512_CODE
  return (dtype == kFloat32 || dtype == kBFloat16) && cpu::has_avx512();
#else
  (void)dtype;
  return false;
#endif
}

bool mask_lora_has_amx(int dtype, std::int64_t rank) {
  return DSPEC_AMX_CODE && dtype == kBFloat16 && rank >= 1 && rank <= kMaskLoraAmxRank && cpu::has_amx_bf16();
}

std::int64_t mask_lora_packed_size(std::int64_t k, std::int64_t n) {
  return kMaskLoraAmxRank * ((k + 31) / 32 * 32 + (n + 15) / 16 * 16);
}

void mask_lora_pack_cpu(const void* a, const void* bt, int weight_dtype, std::int64_t rank, std::int64_t k,
                        std::int64_t n, std::uint16_t* packed) {
  const auto value = [weight_dtype](const void* base, std::int64_t i) -> std::uint16_t {
    return weight_dtype == kBFloat16 ? static_cast<const std::uint16_t*>(base)[i]
                                     : dt::float_to_bf16(static_cast<const float*>(base)[i]);
  };
  const std::int64_t kp = (k + 31) / 32 * 32, rp = kMaskLoraAmxRank;
  std::fill(packed, packed + mask_lora_packed_size(k, n), std::uint16_t(0));
  // A: [kp / 32][16 k pairs][16 ranks][2]: element (c, r) at ((c / 2) * rp + r) * 2 + c % 2
  for (std::int64_t r = 0; r < rank; ++r)
    for (std::int64_t c = 0; c < k; ++c) packed[((c / 2) * rp + r) * 2 + c % 2] = value(a, r * k + c);
  // B^T: [np / 16][8 rank pairs][16 outputs][2]: element (r, o) of block o / 16
  std::uint16_t* pb = packed + kp * rp;
  for (std::int64_t r = 0; r < rank; ++r)
    for (std::int64_t o = 0; o < n; ++o)
      pb[(o / 16) * rp * 16 + ((r / 2) * 16 + o % 16) * 2 + r % 2] = value(bt, r * n + o);
}

void mask_lora_cpu(const MaskLoraArgs& a) {
  const bool w16 = a.weight_dtype == kBFloat16;
#if DSPEC_AMX_CODE
  if (a.packed != nullptr && (a.isa == kLinearAuto || a.isa == kLinearAmx) && mask_lora_has_amx(a.dtype, a.rank)) {
    // groups of 16 rows; a second thread only from two groups (each reads all of the adapter)
    const std::int64_t groups = (a.num_rows + kLoraTile - 1) / kLoraTile;
    cpu::parallel_rows(
        groups, 1, a.num_threads, [&](std::int64_t g0, std::int64_t g1) { mask_lora_rows_amx(a, g0, g1); }, 1);
    return;
  }
#endif
#if DSPEC_AVX512_CODE
  if (a.isa != kLinearGeneric && mask_lora_has_avx512(a.dtype)) {
    // every thread streams all of A and B^T: a second thread pays only with two full row
    // blocks to share them (4 rows on two threads measured slower than on one)
    const std::int64_t width = (a.k + a.n) * a.rank;
    cpu::parallel_rows(
        a.num_rows, width, a.num_threads,
        [&](std::int64_t r0, std::int64_t r1) {
          if (a.dtype == kBFloat16) {
            w16 ? mask_lora_rows_avx512<kBFloat16, kBFloat16>(a, r0, r1)
                : mask_lora_rows_avx512<kBFloat16, kFloat32>(a, r0, r1);
          } else {
            w16 ? mask_lora_rows_avx512<kFloat32, kBFloat16>(a, r0, r1)
                : mask_lora_rows_avx512<kFloat32, kFloat32>(a, r0, r1);
          }
        },
        2 * kLoraRows * width);
    return;
  }
#endif
  // a row costs ~(k + n) * rank multiply-adds; a block's few [MASK] rows stay on one thread
  cpu::parallel_rows(a.num_rows, (a.k + a.n) * a.rank, a.num_threads, [&](std::int64_t r0, std::int64_t r1) {
    switch (a.dtype) {
      case kFloat16: w16 ? mask_lora_f16_w16(a, r0, r1) : mask_lora_f16(a, r0, r1); break;
      case kBFloat16: w16 ? mask_lora_bf16_w16(a, r0, r1) : mask_lora_bf16(a, r0, r1); break;
      default: w16 ? mask_lora_f32_w16(a, r0, r1) : mask_lora_f32(a, r0, r1); break;
    }
  });
}

}  // namespace dspec
