// The mask-selective adapter's update at the [MASK] rows on the CPU; see mask_lora.h.
#include <algorithm>
#include <cstdint>
#include <vector>

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
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
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
        lora_store<DT>(yr + c * kLoraLanes,
                       _mm512_add_ps(cpu::load_f32<DT>(yr + c * kLoraLanes, m[c]), delta), m[c]);
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

DSPEC_CPU_CLONES void mask_lora_f32(const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1) {
  mask_lora_rows<kFloat32, kFloat32>(a, r0, r1);
}
DSPEC_CPU_CLONES void mask_lora_f16(const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1) {
  mask_lora_rows<kFloat16, kFloat32>(a, r0, r1);
}
DSPEC_CPU_CLONES void mask_lora_bf16(const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1) {
  mask_lora_rows<kBFloat16, kFloat32>(a, r0, r1);
}
DSPEC_CPU_CLONES void mask_lora_f32_w16(const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1) {
  mask_lora_rows<kFloat32, kBFloat16>(a, r0, r1);
}
DSPEC_CPU_CLONES void mask_lora_f16_w16(const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1) {
  mask_lora_rows<kFloat16, kBFloat16>(a, r0, r1);
}
DSPEC_CPU_CLONES void mask_lora_bf16_w16(const MaskLoraArgs& a, std::int64_t r0, std::int64_t r1) {
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

void mask_lora_cpu(const MaskLoraArgs& a) {
  const bool w16 = a.weight_dtype == kBFloat16;
#if DSPEC_AVX512_CODE
  if (a.isa != kLinearGeneric && mask_lora_has_avx512(a.dtype)) {
    // every thread streams all of A and B^T: a second thread pays only with two full row
    // blocks to share them (4 rows on two threads measured slower than on one)
    const std::int64_t width = (a.k + a.n) * a.rank;
    cpu::parallel_rows(a.num_rows, width, a.num_threads, [&](std::int64_t r0, std::int64_t r1) {
      if (a.dtype == kBFloat16) {
        w16 ? mask_lora_rows_avx512<kBFloat16, kBFloat16>(a, r0, r1) : mask_lora_rows_avx512<kBFloat16, kFloat32>(a, r0, r1);
      } else {
        w16 ? mask_lora_rows_avx512<kFloat32, kBFloat16>(a, r0, r1) : mask_lora_rows_avx512<kFloat32, kFloat32>(a, r0, r1);
      }
    }, 2 * kLoraRows * width);
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
