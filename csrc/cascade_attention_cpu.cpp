// cascade_attention on the CPU: flash-style online softmax (fp32 state) over each request's
// keys -- its cached prefix, then its suffix under the mask -- as one sequence: key index t
// is prefix row t for t < P and suffix key t - P after.
//
// Position-invariant arithmetic: the keys are cut into chunks of kSplitKeys and tiles of
// kKeyTile at fixed key indices, prefix and suffix alike (a tile may hold the last prefix
// rows and the first suffix keys); each chunk runs its tiles from a fresh softmax state and
// the chunk states are folded left in chunk order (fold_state).  A query's result then
// depends only on the keys it sees and their indices: a chain of N tokens verified in one
// forward gets, row for row, the bits of N one-token forwards that found the earlier tokens
// in the cache (a masked key adds an exact zero; a chunk it cannot see folds as a no-op),
// so greedy speculative decoding equals one-token decoding in bf16 too, not only in fp32.
// Compacted rows: a query whose visible suffix keys are not the first k of the suffix (a
// tree node's ancestors, an SSD copy, a padding row) sees them at the key indices they
// would have as its own chain -- prefix, then its visible suffix keys in order, then
// nothing -- so its bits are those of the one-token steps that decode that chain, not of
// the layout it was verified in.  Such rows leave the shared tiles from the first tile
// holding suffix keys on and run that tile and the next ones on their own key list (the
// same kernels on up to 64 keys; the prefix tiles before stay shared).
//
// Work unit: (request b, group of KV heads, query tile, chunks).  A head's rows are the
// (token, head) pairs of the tile's tokens and the G = Hq / Hkv query heads of that KV head,
// so every key / value tile is read and converted once for all of them.  A unit runs its
// request's chunks one after another, or -- when (request, head group, query tile) units
// would leave threads idle, as in a decode step -- one chunk each (flash-decoding's
// split-K): each keeps its chunk state and the chunk that finishes last folds them.  Either
// way the same chunk states are folded in the same order, so the result is identical for
// any thread count, batch or N.
// Key tiles are the outer loop and the unit's heads the inner one: K / V rows (all heads
// side by side in memory) stream in order, once.  Per key tile of kKeyTile (64) keys and head:
//   pack_k   K rows -> fp32 K^T [Dp, 64] (in-register 16x16 transposes on AVX-512)
//   pack_v   V rows -> fp32 [64, Dp] (fp32 rows are read in place when D % 16 == 0 and the
//            tile is small or D <= 64)
//   qk       S [M, 64] = Qs [M, Dp] K^T      (Qs = q * sm_scale * log2 e, packed once)
//   softmax  mask (two packed words per row for a suffix tile), running max / sum, P in S
//   pv       O [M, Dp] = alpha * O + P V
// Dp is D rounded up to 16 (zero padded).  Scores live in log2 units (exp2); lse is
// converted back to the natural log at the end.  A row's arithmetic does not depend on the
// other rows of its tile, on its unit nor on the thread count, so the result is identical
// for any number of threads.
//
// The tile kernels exist twice: AVX-512 intrinsics (picked at run time when the CPU has
// AVX512F/BW/VL + FMA) and portable loops compiled for AVX2+FMA and baseline x86-64
// (DSPEC_CPU_MULTI_V3, picked by the capped instruction-set level).  The driver (tiling, prefix addressing, mask
// words, threads) is shared; the kernels are called once per tile and head.
//
// Measured (1 thread, Xeon with AVX-512, fp32): qk runs at the FMA peak, pv near it; the
// rest (transposes, softmax, driver) is ~25 % of the time at N = 16.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "cascade_attention.h"
#include "cpu_math.h"
#include "cpu_amx.h"
#include "cpu_avx512.h"
#include "cpu_features.h"
#include "cpu_parallel.h"
#include "dspec.h"
#include "dtype.h"

#define DSPEC_CA_INLINE inline __attribute__((always_inline))

namespace dspec {
namespace {

constexpr int kKeyTile = 64;                // keys per tile: two mask words
constexpr int kPvChunk = 4;                 // d vectors per P V register block (x 6 rows)
constexpr std::int64_t kMaxTileRows = 128;  // rows (token x head) of a work unit, at most
// Threads: below kMinParallelFlops (~50 us of work on one core) a call runs on the calling
// thread (waking a sleeping worker costs tens of microseconds, more on a busy machine);
// above, at most one thread per kFlopsPerThread.  (With 16e6 / 8e6 calls of
// 4-10 MFLOP ran alone at 50-90 us where two threads take 32-51 us -- 32/8/128 and
// 9/3/64 heads, N 16, no prefix, fp32 and bf16, alternating processes, 2-core Xeon.)
// A decode step's attention (N = 1) is a read of the cached K / V: below kMinParallelFlops
// it still takes the pool (workers spin between the kernels of a step) from
// kMinParallelBytes of prefix K / V on, one thread per kBytesPerThread.
constexpr double kMinParallelFlops = 4e6;
constexpr double kFlopsPerThread = 2e6;
constexpr double kMinParallelBytes = 128e3;
constexpr double kBytesPerThread = 96e3;
// prefix keys per chunk (a multiple of kKeyTile)
constexpr std::int64_t kSplitKeys = 256;
constexpr float kLazyMax = 8.0f;  // see softmax_rows
// KV heads per work unit: as many as keep their Q and O rows within this (L2) budget; a
// unit streams whole K / V rows (its heads side by side in memory) once.
constexpr std::int64_t kUnitStateBytes = std::int64_t(512) << 10;

// ------------------------------------------------------------------------------ kernels
using PackFn = void (*)(const void* const* rows, int kt, int dtype, std::int64_t d, std::int64_t dp, float* out);
using QkFn = void (*)(const float* qp, std::int64_t m, std::int64_t dp, const float* kt, int nv, float* s, float scale);
using SoftmaxFn = void (*)(float* s, std::int64_t m, int kt, int nv, const std::uint64_t* bits, float* mrun,
                           float* lrun, float* alpha);
using PvFn = void (*)(const float* p, std::int64_t m, int kt, const float* const* vrows, std::int64_t dp,
                      const float* alpha, float* o);

using PrepareQFn = void (*)(float* qp, std::int64_t rows, std::int64_t dp);

struct Ops {
  PackFn pack_k;  // K rows -> K^T [dp][kKeyTile]: rows d >= D and columns [kt, 16 * nv) zero
  PackFn pack_v;  // V rows -> [kt][dp]: columns d >= D zero
  QkFn qk;        // s[r][j] = sum_d qp[r][d] kt[d][j], j < 16 * nv (times scale where unscaled_q)
  SoftmaxFn softmax;
  PvFn pv;  // o[r] = alpha[r] o[r] + sum_j p[r][j] v[j]
  // null, or the AMX tiles' re-layout of the scaled Q rows in place (once per unit); the
  // AMX pack_k / pack_v / qk / pv then use their own layouts of the same buffers
  PrepareQFn prepare_q = nullptr;
  // the Q rows come as loaded (not multiplied by sm_scale * log2 e) and qk applies that
  // scale to its float32 products: the AMX tiles then take bf16 Q as one exact operand
  bool unscaled_q = false;
};

// ---- portable loops ------------------------------------------------------------------

using cpu::exp2_nonpos;

template <int DT>
DSPEC_CA_INLINE void pack_k_rows(const void* const* rows, int kt, std::int64_t d, float* out) {
  using T = dt::elem_t<DT>;
  for (int j = 0; j < kt; ++j) {
    const T* row = static_cast<const T*>(rows[j]);
    for (std::int64_t dd = 0; dd < d; ++dd) out[dd * kKeyTile + j] = dt::to_float<DT>(row[dd]);
  }
}

DSPEC_CPU_MULTI_V3(void, pack_k_generic,
                   (const void* const* rows, int kt, int dtype, std::int64_t d, std::int64_t dp, float* out),
                   (rows, kt, dtype, d, dp, out)) {
  const int cols = (kt + 15) / 16 * 16;
  switch (dtype) {
    case kFloat16: pack_k_rows<kFloat16>(rows, kt, d, out); break;
    case kBFloat16: pack_k_rows<kBFloat16>(rows, kt, d, out); break;
    default: pack_k_rows<kFloat32>(rows, kt, d, out); break;
  }
  for (std::int64_t dd = 0; dd < d; ++dd) {
    for (int j = kt; j < cols; ++j) out[dd * kKeyTile + j] = 0.0f;
  }
  for (std::int64_t dd = d; dd < dp; ++dd) {
    for (int j = 0; j < cols; ++j) out[dd * kKeyTile + j] = 0.0f;
  }
}

template <int DT>
DSPEC_CA_INLINE void pack_v_rows(const void* const* rows, int kt, std::int64_t d, std::int64_t dp, float* out) {
  using T = dt::elem_t<DT>;
  for (int j = 0; j < kt; ++j) {
    const T* row = static_cast<const T*>(rows[j]);
    float* o = out + j * dp;
    for (std::int64_t dd = 0; dd < d; ++dd) o[dd] = dt::to_float<DT>(row[dd]);
    for (std::int64_t dd = d; dd < dp; ++dd) o[dd] = 0.0f;
  }
}

DSPEC_CPU_MULTI_V3(void, pack_v_generic,
                   (const void* const* rows, int kt, int dtype, std::int64_t d, std::int64_t dp, float* out),
                   (rows, kt, dtype, d, dp, out)) {
  switch (dtype) {
    case kFloat16: pack_v_rows<kFloat16>(rows, kt, d, dp, out); break;
    case kBFloat16: pack_v_rows<kBFloat16>(rows, kt, d, dp, out); break;
    default: pack_v_rows<kFloat32>(rows, kt, d, dp, out); break;
  }
}

// (pre-scaled Q rows: scale is 1)
DSPEC_CPU_MULTI_V3(void, qk_generic,
                   (const float* qp, std::int64_t m, std::int64_t dp, const float* kt, int nv, float* s, float unused6),
                   (qp, m, dp, kt, nv, s, unused6)) {
  const int cols = 16 * nv;
  for (std::int64_t r = 0; r < m; ++r) {
    alignas(64) float acc[kKeyTile] = {};
    const float* q = qp + r * dp;
    for (std::int64_t dd = 0; dd < dp; ++dd) {
      const float qd = q[dd];
      const float* k = kt + dd * kKeyTile;
      for (int j = 0; j < kKeyTile; ++j) acc[j] += qd * k[j];
    }
    for (int j = 0; j < cols; ++j) s[r * kKeyTile + j] = acc[j];
  }
}

DSPEC_CPU_MULTI_V3(void, softmax_generic,
                   (float* s, std::int64_t m, int kt, int nv, const std::uint64_t* bits, float* mrun, float* lrun,
                    float* alpha),
                   (s, m, kt, nv, bits, mrun, lrun, alpha)) {
  const int cols = 16 * nv;
  const std::uint64_t kt_bits = kt >= 64 ? ~std::uint64_t(0) : ((std::uint64_t(1) << kt) - 1);
  for (std::int64_t r = 0; r < m; ++r) {
    float* row = s + r * kKeyTile;
    const std::uint64_t rb = bits ? (bits[r] & kt_bits) : kt_bits;
    float mx = -INFINITY;
    for (int j = 0; j < cols; ++j) {
      const bool on = (rb >> j) & 1u;
      row[j] = on ? row[j] : -INFINITY;
      mx = row[j] > mx ? row[j] : mx;
    }
    const float old = mrun[r];
    const float nm = std::max(old, mx);
    if (rb == 0 || !(nm > -INFINITY)) {
      for (int j = 0; j < cols; ++j) row[j] = 0.0f;
      alpha[r] = 1.0f;
      continue;
    }
    const float al = exp2_nonpos(old - nm);  // 0 when old = -inf
    float sum = 0.0f;
    for (int j = 0; j < cols; ++j) {
      const float p = exp2_nonpos(row[j] - nm);
      row[j] = p;
      sum += p;
    }
    lrun[r * 16] = lrun[r * 16] * al + sum;
    mrun[r] = nm;
    alpha[r] = al;
  }
}

DSPEC_CPU_MULTI_V3(void, pv_generic,
                   (const float* p, std::int64_t m, int kt, const float* const* vrows, std::int64_t dp,
                    const float* alpha, float* o),
                   (p, m, kt, vrows, dp, alpha, o)) {
  for (std::int64_t r = 0; r < m; ++r) {
    float* orow = o + r * dp;
    const float al = alpha[r];
    for (std::int64_t dd = 0; dd < dp; ++dd) orow[dd] *= al;
    const float* prow = p + r * kKeyTile;
    for (int j = 0; j < kt; ++j) {
      const float pj = prow[j];
      if (pj == 0.0f) continue;
      const float* v = vrows[j];
      for (std::int64_t dd = 0; dd < dp; ++dd) orow[dd] += pj * v[dd];
    }
  }
}

constexpr Ops kGenericOps = {pack_k_generic, pack_v_generic, qk_generic, softmax_generic, pv_generic};

// ---- AVX2 + FMA tiles ------------------------------------------------------------------
// qk and pv register-blocked on 8-lane vectors (the portable loops keep an output row in
// memory and the pv update re-reads it for every key): a block holds MR rows x NC vectors
// of accumulators (MR * NC <= 12 of the 16 registers); every row sums in the portable
// loops' order (qk over d, pv over keys), so a row's result does not depend on the others.

#if defined(__x86_64__) && defined(__GNUC__)
#define DSPEC_CA_AVX2 __attribute__((target("avx2,fma")))
#define DSPEC_CA_AVX2_INLINE DSPEC_CA_AVX2 inline __attribute__((always_inline))

// s[r][c0 + 8c ...] for MR rows, NC vectors of key columns
template <int MR, int NC>
DSPEC_CA_AVX2_INLINE void qk_block_avx2(const float* q, std::int64_t dp, const float* kt, float* s) {
  __m256 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (std::int64_t dd = 0; dd < dp; ++dd) {
    __m256 kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = _mm256_load_ps(kt + dd * kKeyTile + 8 * c);
    for (int r = 0; r < MR; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + r * dp + dd);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(qb, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) _mm256_store_ps(s + r * kKeyTile + 8 * c, acc[r][c]);
}

template <int NC, int R>
DSPEC_CA_AVX2_INLINE void qk_tail_avx2(std::int64_t rem, const float* q, std::int64_t dp, const float* kt, float* s) {
  if constexpr (R > 0) {
    if (rem == R) {
      qk_block_avx2<R, NC>(q, dp, kt, s);
    } else {
      qk_tail_avx2<NC, R - 1>(rem, q, dp, kt, s);
    }
  }
}

template <int NC>
DSPEC_CA_AVX2_INLINE void qk_cols_avx2(const float* qp, std::int64_t m, std::int64_t dp, const float* kt, float* s) {
  constexpr int MR = 12 / NC;
  std::int64_t r = 0;
  for (; r + MR <= m; r += MR) qk_block_avx2<MR, NC>(qp + r * dp, dp, kt, s + r * kKeyTile);
  qk_tail_avx2<NC, MR - 1>(m - r, qp + r * dp, dp, kt, s + r * kKeyTile);
}

// (pre-scaled Q rows: scale is 1); key columns in chunks of at most 32
DSPEC_CA_AVX2 void qk_avx2(const float* qp, std::int64_t m, std::int64_t dp, const float* kt, int nv, float* s, float) {
  for (int c0 = 0; c0 < 16 * nv; c0 += 32) {
    if (16 * nv - c0 >= 32) {
      qk_cols_avx2<4>(qp, m, dp, kt + c0, s + c0);
    } else {
      qk_cols_avx2<2>(qp, m, dp, kt + c0, s + c0);
    }
  }
}

// O rows [MR] x NC vectors of d from d0: alpha * O + P V
template <int MR, int NC>
DSPEC_CA_AVX2_INLINE void pv_block_avx2(const float* p, int kt, const float* const* vrows, std::int64_t d0,
                                        std::int64_t dp, const float* alpha, float* o) {
  __m256 acc[MR][NC];
  for (int r = 0; r < MR; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(o + r * dp + d0 + 8 * c), al);
  }
  for (int j = 0; j < kt; ++j) {
    const float* v = vrows[j] + d0;
    __m256 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm256_loadu_ps(v + 8 * c);
    for (int r = 0; r < MR; ++r) {
      const __m256 pb = _mm256_broadcast_ss(p + r * kKeyTile + j);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(pb, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + r * dp + d0 + 8 * c, acc[r][c]);
}

template <int NC, int R>
DSPEC_CA_AVX2_INLINE void pv_tail_avx2(std::int64_t rem, const float* p, int kt, const float* const* vrows,
                                       std::int64_t d0, std::int64_t dp, const float* alpha, float* o) {
  if constexpr (R > 0) {
    if (rem == R) {
      pv_block_avx2<R, NC>(p, kt, vrows, d0, dp, alpha, o);
    } else {
      pv_tail_avx2<NC, R - 1>(rem, p, kt, vrows, d0, dp, alpha, o);
    }
  }
}

template <int NC>
DSPEC_CA_AVX2_INLINE void pv_rows_avx2(const float* p, std::int64_t m, int kt, const float* const* vrows,
                                       std::int64_t d0, std::int64_t dp, const float* alpha, float* o) {
  constexpr int MR = 12 / NC;  // 6 rows of 2 vectors
  std::int64_t r = 0;
  for (; r + MR <= m; r += MR) pv_block_avx2<MR, NC>(p + r * kKeyTile, kt, vrows, d0, dp, alpha + r, o + r * dp);
  pv_tail_avx2<NC, MR - 1>(m - r, p + r * kKeyTile, kt, vrows, d0, dp, alpha + r, o + r * dp);
}

// d in chunks of 16 (dp is a multiple of 16): 6 rows x 2 vectors a block, 12 accumulators,
// 2 V vectors and one broadcast in the 16 registers (3 x 4 blocks need 17: one accumulator
// then lives on the stack and its chain runs through store-to-load forwarding)
DSPEC_CA_AVX2 void pv_avx2(const float* p, std::int64_t m, int kt, const float* const* vrows, std::int64_t dp,
                           const float* alpha, float* o) {
  for (std::int64_t d0 = 0; d0 < dp; d0 += 16) pv_rows_avx2<2>(p, m, kt, vrows, d0, dp, alpha, o);
}

// 2^x on 8 lanes for x <= kLazyMax: x = n + f (n = round(x)), Cephes' 2^f polynomial on
// [-0.5, 0.5] as fused multiply-adds (exp2_nonpos' coefficients), 2^n by the exponent
// bits; 0 at and below 2^-126 and for -inf and NaN (no subnormal reaches a sum).
DSPEC_CA_AVX2_INLINE __m256 exp2_avx2(__m256 x) {
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));  // NaN -> -126
  const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(xc, n);
  __m256 q = _mm256_set1_ps(1.535336188319500e-4f);
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(1.339887440266574e-3f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(9.618437357674640e-3f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(5.550332471162809e-2f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(2.402264791363012e-1f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(6.931472028550421e-1f));
  q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GT_OQ);
  return _mm256_and_ps(_mm256_mul_ps(q, _mm256_castsi256_ps(bits)), normal);
}

// The 8 mask bits of `byte` as 8 lanes (all ones where set)
DSPEC_CA_AVX2_INLINE __m256 lane_mask_avx2(unsigned byte) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(byte)), lanes);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lanes));
}

DSPEC_CA_AVX2_INLINE float hmax_avx2(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// The AVX-512 softmax_rows on 8-lane halves: the lazy running max (kLazyMax), P in place
// (0 where masked), and the row sums as the same 16 partial lanes (lrun [rows][16]: lane j
// sums the columns j mod 16 in key order), so a row's sums are those of the AVX-512 tiles
// wherever no probability falls below 2^-126.
DSPEC_CA_AVX2 void softmax_avx2(float* s, std::int64_t m, int kt, int nv, const std::uint64_t* bits, float* mrun,
                                float* lrun, float* alpha) {
  const std::uint64_t kt_bits = kt >= 64 ? ~std::uint64_t(0) : ((std::uint64_t(1) << kt) - 1);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const int nh = 2 * nv;  // 8-lane vectors of the tile's columns
  for (std::int64_t r = 0; r < m; ++r) {
    float* row = s + r * kKeyTile;
    const std::uint64_t rb = bits ? (bits[r] & kt_bits) : kt_bits;
    if (rb == 0) {
      for (int c = 0; c < nh; ++c) _mm256_store_ps(row + 8 * c, _mm256_setzero_ps());
      alpha[r] = 1.0f;
      continue;
    }
    const float old = mrun[r];
    const __m256 thr = _mm256_set1_ps(old + kLazyMax);
    __m256 x[8], km[8];
    __m256 over = _mm256_setzero_ps();
    const bool full = rb == ~std::uint64_t(0);
    for (int c = 0; c < nh; ++c) {
      const __m256 v = _mm256_load_ps(row + 8 * c);
      km[c] = full ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))
                   : lane_mask_avx2(static_cast<unsigned>(rb >> (8 * c)) & 0xffu);
      x[c] = _mm256_blendv_ps(ninf, v, km[c]);
      over = _mm256_or_ps(over, _mm256_cmp_ps(x[c], thr, _CMP_GT_OQ));
    }
    float nm = old, al = 1.0f;
    if (!_mm256_testz_ps(over, over)) {
      __m256 mx = x[0];
      for (int c = 1; c < nh; ++c) mx = _mm256_max_ps(mx, x[c]);
      nm = std::max(old, hmax_avx2(mx));
      al = exp2_nonpos(old - nm);  // 0 when old = -inf
    }
    const __m256 nmv = _mm256_set1_ps(nm);
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int c = 0; c < nh; ++c) {
      // exp2_avx2 gives 0 for -inf and NaN (a row that has seen only -inf scores)
      const __m256 p = _mm256_and_ps(km[c], exp2_avx2(_mm256_sub_ps(x[c], nmv)));
      _mm256_store_ps(row + 8 * c, p);
      sum[c & 1] = _mm256_add_ps(sum[c & 1], p);
    }
    const __m256 alv = _mm256_set1_ps(al);
    for (int h = 0; h < 2; ++h) {
      float* l = lrun + r * 16 + 8 * h;
      _mm256_store_ps(l, _mm256_fmadd_ps(_mm256_load_ps(l), alv, sum[h]));
    }
    mrun[r] = nm;
    alpha[r] = al;
  }
}

constexpr Ops kAvx2Ops = {pack_k_generic, pack_v_generic, qk_avx2, softmax_avx2, pv_avx2};
#define DSPEC_CA_HAS_AVX2 1
#else
#define DSPEC_CA_HAS_AVX2 0
#endif

// ---- AVX-512 ---------------------------------------------------------------------------
#if DSPEC_AVX512_CODE

// r[i] <- column i of the 16x16 block whose rows are r[0..15].
DSPEC_AVX512_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
}

// 16 elements of a row from element d0 (dn valid, the rest 0) as fp32.
template <int DT>
DSPEC_AVX512_INLINE __m512 load16(const void* row, std::int64_t d0, __mmask16 km) {
  return cpu::load_f32<DT>(static_cast<const dt::elem_t<DT>*>(row) + d0, km);
}

using cpu::lanes;

template <int DT>
DSPEC_AVX512 void pack_k_avx512_t(const void* const* rows, int kt, std::int64_t d, std::int64_t dp, float* out) {
  for (int j0 = 0; j0 < kt; j0 += 16) {
    const int jn = std::min(16, kt - j0);
    for (std::int64_t d0 = 0; d0 < dp; d0 += 16) {
      const __mmask16 km = lanes(d - d0);
      __m512 r[16];
      for (int jj = 0; jj < 16; ++jj) r[jj] = jj < jn ? load16<DT>(rows[j0 + jj], d0, km) : _mm512_setzero_ps();
      transpose16(r);
      for (int dd = 0; dd < 16; ++dd) _mm512_store_ps(out + (d0 + dd) * kKeyTile + j0, r[dd]);
    }
  }
}

DSPEC_AVX512 void pack_k_avx512(const void* const* rows, int kt, int dtype, std::int64_t d, std::int64_t dp,
                                float* out) {
  switch (dtype) {
    case kFloat16: pack_k_avx512_t<kFloat16>(rows, kt, d, dp, out); break;
    case kBFloat16: pack_k_avx512_t<kBFloat16>(rows, kt, d, dp, out); break;
    default: pack_k_avx512_t<kFloat32>(rows, kt, d, dp, out); break;
  }
}

template <int DT>
DSPEC_AVX512 void pack_v_avx512_t(const void* const* rows, int kt, std::int64_t d, std::int64_t dp, float* out) {
  for (int j = 0; j < kt; ++j) {
    for (std::int64_t d0 = 0; d0 < dp; d0 += 16) {
      _mm512_store_ps(out + j * dp + d0, load16<DT>(rows[j], d0, lanes(d - d0)));
    }
  }
}

DSPEC_AVX512 void pack_v_avx512(const void* const* rows, int kt, int dtype, std::int64_t d, std::int64_t dp,
                                float* out) {
  switch (dtype) {
    case kFloat16: pack_v_avx512_t<kFloat16>(rows, kt, d, dp, out); break;
    case kBFloat16: pack_v_avx512_t<kBFloat16>(rows, kt, d, dp, out); break;
    default: pack_v_avx512_t<kFloat32>(rows, kt, d, dp, out); break;
  }
}

// S rows [MR] x key vectors [NV]: acc in registers, one pass over d.
template <int MR, int NV>
DSPEC_AVX512_INLINE void qk_block(const float* q, std::int64_t dp, const float* kt, float* s) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (std::int64_t dd = 0; dd < dp; ++dd) {
    __m512 kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = _mm512_load_ps(kt + dd * kKeyTile + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r * dp + dd]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(qb, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) _mm512_store_ps(s + r * kKeyTile + 16 * c, acc[r][c]);
  }
}

template <int NV, int R>
DSPEC_AVX512_INLINE void qk_tail(std::int64_t rem, const float* q, std::int64_t dp, const float* kt, float* s) {
  if constexpr (R > 0) {
    if (rem == R) {
      qk_block<R, NV>(q, dp, kt, s);
    } else {
      qk_tail<NV, R - 1>(rem, q, dp, kt, s);
    }
  }
}

template <int NV>
DSPEC_AVX512 void qk_avx512_nv(const float* qp, std::int64_t m, std::int64_t dp, const float* kt, float* s) {
  constexpr int MR = NV >= 4 ? 6 : (NV == 3 ? 8 : 12);  // <= 24 accumulators
  std::int64_t r = 0;
  for (; r + MR <= m; r += MR) qk_block<MR, NV>(qp + r * dp, dp, kt, s + r * kKeyTile);
  qk_tail<NV, MR - 1>(m - r, qp + r * dp, dp, kt, s + r * kKeyTile);
}

// (pre-scaled Q rows: scale is 1)
DSPEC_AVX512 void qk_avx512(const float* qp, std::int64_t m, std::int64_t dp, const float* kt, int nv, float* s,
                            float) {
  switch (nv) {
    case 1: qk_avx512_nv<1>(qp, m, dp, kt, s); break;
    case 2: qk_avx512_nv<2>(qp, m, dp, kt, s); break;
    case 3: qk_avx512_nv<3>(qp, m, dp, kt, s); break;
    default: qk_avx512_nv<4>(qp, m, dp, kt, s); break;
  }
}

// 2^x (x <= kLazyMax here): x = n + f (n = round(x)), Cephes' 2^f polynomial on [-0.5, 0.5],
// scalef by n; x below -150 (and -inf, NaN) gives exactly 0.
DSPEC_AVX512_INLINE __m512 exp2_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));  // NaN -> -150
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(cpu::exp2_poly16(_mm512_sub_ps(x, n)), n);
}

// Online softmax of rows of a score tile, in place (P, 0 where masked).  Lazy running max:
// a row keeps its max while no score exceeds it by more than kLazyMax (P <= 2^kLazyMax,
// far from fp32 overflow), so most tiles need no horizontal max and no rescale.  The row
// sums stay 16-lane vectors (lrun [rows][16]), reduced once at the end.
DSPEC_AVX512_INLINE void softmax_rows(float* s, std::int64_t m, int kt, int nv, const std::uint64_t* bits, float* mrun,
                                      float* lrun, float* alpha) {
  const std::uint64_t kt_bits = kt >= 64 ? ~std::uint64_t(0) : ((std::uint64_t(1) << kt) - 1);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (std::int64_t r = 0; r < m; ++r) {
    float* row = s + r * kKeyTile;
    const std::uint64_t rb = bits ? (bits[r] & kt_bits) : kt_bits;
    if (rb == 0) {
      for (int c = 0; c < nv; ++c) _mm512_store_ps(row + 16 * c, _mm512_setzero_ps());
      alpha[r] = 1.0f;
      continue;
    }
    const float old = mrun[r];
    const __m512 thr = _mm512_set1_ps(old + kLazyMax);
    if (rb == ~std::uint64_t(0)) {  // a full tile, every key visible (nv == 4)
      __m512 x[4];
      for (int c = 0; c < 4; ++c) x[c] = _mm512_load_ps(row + 16 * c);
      const __mmask16 over =
          static_cast<__mmask16>(_mm512_cmp_ps_mask(x[0], thr, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x[1], thr, _CMP_GT_OQ) |
                                 _mm512_cmp_ps_mask(x[2], thr, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x[3], thr, _CMP_GT_OQ));
      float nm = old, al = 1.0f;
      if (over) {
        nm = std::max(old, _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]))));
        al = exp2_nonpos(old - nm);
      }
      const __m512 nmv = _mm512_set1_ps(nm);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        const __m512 p = exp2_avx512(_mm512_sub_ps(x[c], nmv));
        _mm512_store_ps(row + 16 * c, p);
        sum = _mm512_add_ps(sum, p);
      }
      _mm512_store_ps(lrun + r * 16, _mm512_fmadd_ps(_mm512_load_ps(lrun + r * 16), _mm512_set1_ps(al), sum));
      mrun[r] = nm;
      alpha[r] = al;
      continue;
    }
    __m512 x[4];
    __mmask16 km[4];
    __mmask16 over = 0;
    for (int c = 0; c < nv; ++c) {
      km[c] = static_cast<__mmask16>(rb >> (16 * c));
      x[c] = _mm512_mask_blend_ps(km[c], ninf, _mm512_load_ps(row + 16 * c));
      over = static_cast<__mmask16>(over | _mm512_cmp_ps_mask(x[c], thr, _CMP_GT_OQ));
    }
    float nm = old, al = 1.0f;
    if (over) {
      __m512 mx = x[0];
      for (int c = 1; c < nv; ++c) mx = _mm512_max_ps(mx, x[c]);
      nm = std::max(old, _mm512_reduce_max_ps(mx));
      al = exp2_nonpos(old - nm);  // 0 when old = -inf
    }
    const __m512 nmv = _mm512_set1_ps(nm);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < nv; ++c) {
      // exp2_avx512 gives 0 for -inf and NaN (a row that has seen only -inf scores)
      const __m512 p = _mm512_maskz_mov_ps(km[c], exp2_avx512(_mm512_sub_ps(x[c], nmv)));
      _mm512_store_ps(row + 16 * c, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_store_ps(lrun + r * 16, _mm512_fmadd_ps(_mm512_load_ps(lrun + r * 16), _mm512_set1_ps(al), sum));
    mrun[r] = nm;
    alpha[r] = al;
  }
}

DSPEC_AVX512 void softmax_avx512(float* s, std::int64_t m, int kt, int nv, const std::uint64_t* bits, float* mrun,
                                 float* lrun, float* alpha) {
  softmax_rows(s, m, kt, nv, bits, mrun, lrun, alpha);
}

// O rows [MR] x d vectors [DV] (one chunk of the row): alpha * O + P V.
template <int MR, int DV>
DSPEC_AVX512_INLINE void pv_block(const float* p, int kt, const float* const* vrows, std::int64_t d0, std::int64_t dp,
                                  const float* alpha, float* o) {
  __m512 acc[MR][DV];
  for (int r = 0; r < MR; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o + r * dp + 16 * c), al);
  }
  for (int j = 0; j < kt; ++j) {
    const float* v = vrows[j] + d0;
    __m512 vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512 pb = _mm512_set1_ps(p[r * kKeyTile + j]);
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(pb, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < DV; ++c) _mm512_store_ps(o + r * dp + 16 * c, acc[r][c]);
  }
}

template <int DV, int R>
DSPEC_AVX512_INLINE void pv_tail(std::int64_t rem, const float* p, int kt, const float* const* vrows, std::int64_t d0,
                                 std::int64_t dp, const float* alpha, float* o) {
  if constexpr (R > 0) {
    if (rem == R) {
      pv_block<R, DV>(p, kt, vrows, d0, dp, alpha, o);
    } else {
      pv_tail<DV, R - 1>(rem, p, kt, vrows, d0, dp, alpha, o);
    }
  }
}

template <int DV>
DSPEC_AVX512_INLINE void pv_rows(const float* p, std::int64_t m, int kt, const float* const* vrows, std::int64_t d0,
                                 std::int64_t dp, const float* alpha, float* o) {
  constexpr int MR = std::min(12, 24 / DV);
  std::int64_t r = 0;
  for (; r + MR <= m; r += MR) pv_block<MR, DV>(p + r * kKeyTile, kt, vrows, d0, dp, alpha + r, o + r * dp + d0);
  pv_tail<DV, MR - 1>(m - r, p + r * kKeyTile, kt, vrows, d0, dp, alpha + r, o + r * dp + d0);
}

// d in chunks of at most kPvChunk vectors.
DSPEC_AVX512 void pv_avx512(const float* p, std::int64_t m, int kt, const float* const* vrows, std::int64_t dp,
                            const float* alpha, float* o) {
  for (std::int64_t d0 = 0; d0 < dp; d0 += 16 * kPvChunk) {
    switch (std::min<std::int64_t>(kPvChunk, (dp - d0) / 16)) {
      case 1: pv_rows<1>(p, m, kt, vrows, d0, dp, alpha, o); break;
      case 2: pv_rows<2>(p, m, kt, vrows, d0, dp, alpha, o); break;
      case 3: pv_rows<3>(p, m, kt, vrows, d0, dp, alpha, o); break;
      case 4: pv_rows<4>(p, m, kt, vrows, d0, dp, alpha, o); break;
      case 5: pv_rows<5>(p, m, kt, vrows, d0, dp, alpha, o); break;
      case 6: pv_rows<6>(p, m, kt, vrows, d0, dp, alpha, o); break;
      case 7: pv_rows<7>(p, m, kt, vrows, d0, dp, alpha, o); break;
      default: pv_rows<8>(p, m, kt, vrows, d0, dp, alpha, o); break;
    }
  }
}

constexpr Ops kAvx512Ops = {pack_k_avx512, pack_v_avx512, qk_avx512, softmax_avx512, pv_avx512};

#if DSPEC_AMX_CODE
// ---- AMX-BF16 (bf16 inputs, D a multiple of 32) ------------------------------------------
// The same tiles on the tile unit, with float32 precision kept where the AVX-512 code has
// it: Q, K and V are bf16 (exact operands; S = Q K^T exact products summed in float32, then
// multiplied by sm_scale * log2 e once, in float32); the probabilities P are float32 and go
// in as two bf16 terms, x = hi + lo with hi = bf16(x), lo = bf16(x - hi) (16 of x's 24
// mantissa bits; two tile products, accumulated in float32).  A row's result
// depends only on its own Q / P row and the keys, as in the AVX-512 code, so the
// invariances above hold among AMX runs (its bits differ from the AVX-512 ones, so a process
// keeps one isa for every call).
// Layouts (in the float buffers the driver hands out):
//   Q row r (4 dp bytes): [dp] bf16, the rest unused                  (prepare_q, in place)
//   K tile: bf16 [dp / 2 pairs][64 keys][2]   (a B operand of 16 pairs x 16 keys per tile)
//   V tile: bf16 [32 key pairs][dp][2]        (a B operand of 16 key pairs x 16 d per tile)
// Tiles: 0-3 accumulate (S: 16 keys each; O: 16 d each), 4 / 5 the hi / lo A operands,
// 6 / 7 alternate the B operands.
#define DSPEC_CA_AMX DSPEC_AMX_TARGET

// The tile configuration stays loaded across the AMX kernels of one work unit (qk and pv
// run once per key tile and head) and is released when the unit ends (run_unit): loading a
// configuration and releasing it cost ~70 ns together on this project's AMX Xeon (a
// microbenchmark: 4 ns per loop of a tile zero + store, 70-79 ns with a load and release
// around it), the time of ~12 tile products, where a decode step's tile pair does ~8.
thread_local int amx_rows_loaded = 0;
DSPEC_CA_AMX inline void amx_rows(int rows) {
  if (rows == amx_rows_loaded) return;
  cpu::amx_configure(rows, 6);
  amx_rows_loaded = rows;
}
DSPEC_CA_AMX void amx_unit_end() {
  if (amx_rows_loaded == 0) return;
  _tile_release();
  amx_rows_loaded = 0;
}

// hi / lo bf16 terms of 16 floats
DSPEC_CA_AMX inline void split_bf16(__m512 x, __m256i& hi, __m256i& lo) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  hi = (__m256i)h;
  lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, _mm512_cvtpbh_ps(h)));
}

DSPEC_CA_AMX void prepare_q_amx(float* qp, std::int64_t rows, std::int64_t dp) {
  // the rows hold bf16 values as float32 (unscaled_q): their top 16 bits are the bf16
  for (std::int64_t r = 0; r < rows; ++r) {
    float* q = qp + r * dp;
    auto* out = reinterpret_cast<std::uint16_t*>(q);
    for (std::int64_t d0 = 0; d0 < dp; d0 += 16) {  // out's 32 bytes lie below q + d0's 64
      const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(_mm512_load_ps(q + d0)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d0), _mm512_cvtepi32_epi16(bits));
    }
  }
}

DSPEC_CA_AMX void pack_k_amx(const void* const* rows, int kt, int, std::int64_t d, std::int64_t dp, float* out) {
  // 32-bit words (d pairs) transposed 16 keys x 16 pairs at a time: word [pair][key]
  for (int j0 = 0; j0 < kKeyTile; j0 += 16) {
    for (std::int64_t w0 = 0; w0 < dp / 2; w0 += 16) {
      const __mmask16 km = lanes(d / 2 - w0);
      __m512 r[16];
      for (int jj = 0; jj < 16; ++jj) {
        r[jj] = j0 + jj < kt ? _mm512_maskz_loadu_ps(km, static_cast<const std::uint16_t*>(rows[j0 + jj]) + 2 * w0)
                             : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int ww = 0; ww < 16; ++ww) _mm512_store_ps(out + (w0 + ww) * kKeyTile + j0, r[ww]);
    }
  }
}

DSPEC_CA_AMX void pack_v_amx(const void* const* rows, int kt, int, std::int64_t d, std::int64_t dp, float* out) {
  // key pairs interleaved along d: out16[((j / 2) * dp + c) * 2 + j % 2] = V[j][c]
  alignas(64) static constexpr std::uint16_t kLo[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr std::uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo_idx = _mm512_load_si512(kLo), hi_idx = _mm512_load_si512(kHi);
  auto* o = reinterpret_cast<std::uint16_t*>(out);
  for (int j = 0; j < kKeyTile; j += 2) {
    for (std::int64_t c0 = 0; c0 < dp; c0 += 32) {
      const __mmask32 m = d - c0 >= 32 ? ~__mmask32(0) : (d > c0 ? (__mmask32(1) << (d - c0)) - 1 : 0);
      const __m512i a = j < kt ? _mm512_maskz_loadu_epi16(m, static_cast<const std::uint16_t*>(rows[j]) + c0)
                               : _mm512_setzero_si512();
      const __m512i b = j + 1 < kt ? _mm512_maskz_loadu_epi16(m, static_cast<const std::uint16_t*>(rows[j + 1]) + c0)
                                   : _mm512_setzero_si512();
      std::uint16_t* dst = o + ((j / 2) * dp + c0) * 2;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

#define DSPEC_CA_AMX_DOT(C, B, base, stride) \
  do {                                       \
    _tile_loadd(B, base, stride);            \
    _tile_dpbf16ps(C, 4, B);                 \
    _tile_dpbf16ps(C, 5, B);                 \
  } while (0)

DSPEC_CA_AMX void qk_amx(const float* qp, std::int64_t m, std::int64_t dp, const float* kt, int nv, float* s,
                         float scale) {
  const auto* k16 = reinterpret_cast<const std::uint16_t*>(kt);
  constexpr long kB = kKeyTile * 4;  // bytes between the d pairs of a K tile
  const long q_stride = static_cast<long>(dp) * 4;
  for (std::int64_t r0 = 0; r0 < m; r0 += 16) {
    const int mr = static_cast<int>(std::min<std::int64_t>(16, m - r0));
    amx_rows(mr);
    const auto* q16 = reinterpret_cast<const std::uint16_t*>(qp + r0 * dp);
    // only the nv 16-key column tiles that hold keys (softmax reads no others)
    _tile_zero(0);
    if (nv > 1) _tile_zero(1);
    if (nv > 2) _tile_zero(2);
    if (nv > 3) _tile_zero(3);
    for (std::int64_t d0 = 0; d0 < dp; d0 += 32) {
      _tile_loadd(4, q16 + d0, q_stride);
      const std::uint16_t* kb = k16 + (d0 / 2) * kKeyTile * 2;
      _tile_loadd(6, kb, kB);
      _tile_dpbf16ps(0, 4, 6);
      if (nv > 1) {
        _tile_loadd(7, kb + 32, kB);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (nv > 2) {
        _tile_loadd(6, kb + 64, kB);
        _tile_dpbf16ps(2, 4, 6);
      }
      if (nv > 3) {
        _tile_loadd(7, kb + 96, kB);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    float* sr = s + r0 * kKeyTile;
    _tile_stored(0, sr, kKeyTile * 4);
    if (nv > 1) _tile_stored(1, sr + 16, kKeyTile * 4);
    if (nv > 2) _tile_stored(2, sr + 32, kKeyTile * 4);
    if (nv > 3) _tile_stored(3, sr + 48, kKeyTile * 4);
    std::atomic_signal_fence(std::memory_order_seq_cst);  // tile stores are asm
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < mr; ++r) {
      for (int c = 0; c < nv; ++c)
        _mm512_store_ps(sr + r * kKeyTile + 16 * c, _mm512_mul_ps(_mm512_load_ps(sr + r * kKeyTile + 16 * c), sc));
    }
  }
}

DSPEC_CA_AMX void pv_amx(const float* p, std::int64_t m, int kt, const float* const* vrows, std::int64_t dp,
                         const float* alpha, float* o) {
  const auto* v16 = reinterpret_cast<const std::uint16_t*>(vrows[0]);  // pack_v's tile
  alignas(64) std::uint16_t ph[16][kKeyTile], pl[16][kKeyTile];
  const long v_stride = static_cast<long>(dp) * 4;  // bytes between key pairs
  const long o_stride = static_cast<long>(dp) * 4;
  const std::uint64_t kt_bits = kt >= 64 ? ~std::uint64_t(0) : ((std::uint64_t(1) << kt) - 1);
  for (std::int64_t r0 = 0; r0 < m; r0 += 16) {
    const int mr = static_cast<int>(std::min<std::int64_t>(16, m - r0));
    for (int r = 0; r < mr; ++r) {
      const float* pr = p + (r0 + r) * kKeyTile;
      for (int c = 0; c < 4; ++c) {
        __m256i hi, lo;
        split_bf16(_mm512_maskz_load_ps(static_cast<__mmask16>(kt_bits >> (16 * c)), pr + 16 * c), hi, lo);
        _mm256_store_si256(reinterpret_cast<__m256i*>(&ph[r][16 * c]), hi);
        _mm256_store_si256(reinterpret_cast<__m256i*>(&pl[r][16 * c]), lo);
      }
      if (alpha[r0 + r] == 1.0f) continue;  // the lazy max's usual case: O * 1 is O, bit for bit
      float* orow = o + (r0 + r) * dp;
      const __m512 al = _mm512_set1_ps(alpha[r0 + r]);
      for (std::int64_t c = 0; c < dp; c += 16) _mm512_store_ps(orow + c, _mm512_mul_ps(_mm512_load_ps(orow + c), al));
    }
    std::atomic_signal_fence(std::memory_order_seq_cst);  // tile loads are asm
    amx_rows(mr);
    float* orow = o + r0 * dp;
    for (std::int64_t c0 = 0; c0 < dp; c0 += 64) {
      const bool four = dp - c0 >= 64;  // else two (dp is a multiple of 32)
      _tile_loadd(0, orow + c0, o_stride);
      _tile_loadd(1, orow + c0 + 16, o_stride);
      if (four) {
        _tile_loadd(2, orow + c0 + 32, o_stride);
        _tile_loadd(3, orow + c0 + 48, o_stride);
      }
      for (int kb = 0; kb < kt; kb += 32) {  // key blocks past kt hold only zeros
        _tile_loadd(4, &ph[0][kb], kKeyTile * 2);
        _tile_loadd(5, &pl[0][kb], kKeyTile * 2);
        const std::uint16_t* vb = v16 + ((kb / 2) * dp + c0) * 2;
        DSPEC_CA_AMX_DOT(0, 6, vb, v_stride);
        DSPEC_CA_AMX_DOT(1, 7, vb + 32, v_stride);
        if (four) {
          DSPEC_CA_AMX_DOT(2, 6, vb + 64, v_stride);
          DSPEC_CA_AMX_DOT(3, 7, vb + 96, v_stride);
        }
      }
      _tile_stored(0, orow + c0, o_stride);
      _tile_stored(1, orow + c0 + 16, o_stride);
      if (four) {
        _tile_stored(2, orow + c0 + 32, o_stride);
        _tile_stored(3, orow + c0 + 48, o_stride);
      }
    }
  }
}

constexpr Ops kAmxOps = {pack_k_amx, pack_v_amx, qk_amx, softmax_avx512, pv_amx, prepare_q_amx, true};
#endif  // DSPEC_AMX_CODE

#endif  // DSPEC_AVX512_CODE

// ------------------------------------------------------------------------------- driver

struct Geometry {
  std::int64_t group = 1;        // G = Hq / Hkv
  std::int64_t dp = 16;          // D rounded up to 16
  std::int64_t item = 4;         // bytes per element
  std::int64_t words = 1;        // mask words per row
  std::int64_t q_tiles = 1;      // query tiles per request
  std::int64_t tile_tokens = 1;  // tokens per query tile
  std::int64_t head_groups = 1;  // KV head groups per request
  std::int64_t group_heads = 1;  // KV heads per group
  float scale2 = 1.0f;           // sm_scale * log2(e)
  float q_scale = 1.0f;          // applied to the Q rows at load (scale2, or 1 for unscaled_q ops)
  float s_scale = 1.0f;          // applied by qk to its products (1, or scale2 for unscaled_q ops)
};

// One work unit (see the top of the file): chunks [c0, c1) of the request's keys.  The
// units of a split (request, head group, query tile) -- one chunk each, the last one also a
// short last chunk -- share `merge`: their chunk states go to scratch slots slot0 + chunk.
struct Unit {
  std::int64_t b = 0, h0 = 0, i0 = 0, i1 = 0;
  std::int64_t plen = 0;    // the request's prefix length P (keys [0, P + N))
  int c0 = 0, c1 = 1;       // chunks run here
  int chunks = 1;           // the request's chunks
  std::int64_t merge = -1;  // index of the merge counter (split units)
  std::int64_t slot0 = 0;
};

// Chunk states of split units: per slot and head, O [rows][dp], mrun [rows], lrun [rows][16].
struct SplitState {
  float* mem = nullptr;
  std::int64_t slot_floats = 0, head_floats = 0;
  std::atomic<int>* done = nullptr;  // chunks finished, per merge group
};

inline std::int64_t up16(std::int64_t x) { return (x + 15) / 16 * 16; }

// One head's rows of a softmax state: O [rows][dp], running max [rows] (log2 units), sums
// [rows][16].
struct HeadState {
  float* o;
  float* m;
  float* l;
};

// Per-thread scratch, 64-byte aligned, reused across calls on the same thread.  Per KV head
// of a unit: Q [rows][dp], O [rows][dp] and the running max / sum / rescale of each row;
// shared by the heads: the score tile, the packed K^T and V tiles and the mask bits.
struct Workspace {
  std::vector<float> mem;
  std::vector<std::uint64_t> bits;  // per row: the current suffix tile's mask bits
  std::int64_t rows = 0, dp = 0;    // capacity per head
  float* qp = nullptr;              // [heads][rows][dp]
  float* o = nullptr;               // [heads][rows][dp]
  float* mrun = nullptr;            // [heads][up16(rows)] (log2 units)
  float* lrun = nullptr;            // [heads][up16(rows)][16]: row sums as 16 partial lanes
  float* alpha = nullptr;
  float* s = nullptr;     // [rows][64]
  float* kt = nullptr;    // [dp][64]
  float* vt = nullptr;    // [64][dp]
  float* oacc = nullptr;  // the fold of the chunks run so far: [heads][rows][dp]
  float* macc = nullptr;  // [heads][up16(rows)]
  float* lacc = nullptr;  // [heads][up16(rows)][16]
  // compacted tokens of a unit (see the top of the file): per token its entry in `odd`
  // (-1: a regular token); per odd token its first key in `keys` and its key count; `keys`
  // the visible suffix keys of each in order
  std::vector<std::int32_t> odd_of;
  std::vector<std::int64_t> odd;
  std::vector<std::int32_t> keys;

  void reserve_compacted(std::int64_t tokens, std::int64_t n) {
    if (static_cast<std::int64_t>(odd_of.size()) < tokens) odd_of.assign(static_cast<std::size_t>(tokens), -1);
    if (static_cast<std::int64_t>(odd.size()) < 3 * tokens) odd.assign(static_cast<std::size_t>(3 * tokens), 0);
    if (static_cast<std::int64_t>(keys.size()) < tokens * n) keys.assign(static_cast<std::size_t>(tokens * n), 0);
  }

  void reserve(std::int64_t rows_, std::int64_t dp_, std::int64_t heads) {
    rows = rows_;
    dp = dp_;
    const std::int64_t r16 = up16(rows);
    const std::int64_t sizes[11] = {heads * rows * dp, heads * rows * dp, heads * r16,     heads * r16 * 16,
                                    heads * r16,       rows * kKeyTile,   dp * kKeyTile,   kKeyTile * dp,
                                    heads * rows * dp, heads * r16,       heads * r16 * 16};
    std::int64_t total = 16;
    for (std::int64_t x : sizes) total += up16(x);
    if (static_cast<std::int64_t>(mem.size()) < total) mem.assign(static_cast<std::size_t>(total), 0.0f);
    if (static_cast<std::int64_t>(bits.size()) < rows) bits.assign(static_cast<std::size_t>(rows), 0);
    float* base = mem.data();
    base += (16 - (reinterpret_cast<std::uintptr_t>(base) / sizeof(float)) % 16) % 16;
    float** slots[11] = {&qp, &o, &mrun, &lrun, &alpha, &s, &kt, &vt, &oacc, &macc, &lacc};
    for (int i = 0; i < 11; ++i) {
      *slots[i] = base;
      base += up16(sizes[i]);
    }
  }

  // head hi's state of the chunk being run, and of the fold of the chunks run so far
  HeadState chunk_state(std::int64_t hi) const {
    return {o + hi * rows * dp, mrun + hi * up16(rows), lrun + hi * up16(rows) * 16};
  }
  HeadState acc_state(std::int64_t hi) const {
    return {oacc + hi * rows * dp, macc + hi * up16(rows), lacc + hi * up16(rows) * 16};
  }
};

inline std::int64_t index_at(const void* p, int code, std::int64_t i) {
  return code == kInt64 ? static_cast<const std::int64_t*>(p)[i] : static_cast<const std::int32_t*>(p)[i];
}

inline std::int64_t prefix_length(const CascadeAttentionArgs& a, std::int64_t b) {
  if (a.prefix == kPrefixRagged) {
    return index_at(a.prefix_indptr, a.indptr_dtype, b + 1) - index_at(a.prefix_indptr, a.indptr_dtype, b);
  }
  if (a.prefix == kPrefixPaged) return a.prefix_lens[b];
  return 0;
}

// Q rows (token i, head kvh * G + h) -> qp[(i - i0) * G + h][dp], scaled into log2 units.
template <int DT>
void load_q_rows(const CascadeAttentionArgs& a, const Geometry& g, std::int64_t b, std::int64_t kvh, std::int64_t i0,
                 std::int64_t i1, float* qp) {
  using T = dt::elem_t<DT>;
  const T* q = static_cast<const T*>(a.q);
  const std::int64_t D = a.head_dim, G = g.group;
  for (std::int64_t i = i0; i < i1; ++i) {
    for (std::int64_t h = 0; h < G; ++h) {
      const T* src = q + b * a.q_stride[0] + i * a.q_stride[1] + (kvh * G + h) * a.q_stride[2];
      float* dst = qp + ((i - i0) * G + h) * g.dp;
      for (std::int64_t dd = 0; dd < D; ++dd) dst[dd] = dt::to_float<DT>(src[dd]) * g.q_scale;
      for (std::int64_t dd = D; dd < g.dp; ++dd) dst[dd] = 0.0f;
    }
  }
}

template <int DT>
void store_rows(const CascadeAttentionArgs& a, const Geometry& g, const float* o, const float* mrun, const float* lrun,
                std::int64_t b, std::int64_t kvh, std::int64_t i0, std::int64_t i1) {
  using T = dt::elem_t<DT>;
  T* out = static_cast<T*>(a.out);
  const std::int64_t D = a.head_dim, G = g.group;
  for (std::int64_t i = i0; i < i1; ++i) {
    for (std::int64_t h = 0; h < G; ++h) {
      const std::int64_t r = (i - i0) * G + h, head = kvh * G + h;
      T* dst = out + b * a.out_stride[0] + i * a.out_stride[1] + head * a.out_stride[2];
      float l = 0.0f;
      for (int lane = 0; lane < 16; ++lane) l += lrun[r * 16 + lane];
      const float* orow = o + r * g.dp;
      const bool seen = l > 0.0f;
      const float inv = seen ? 1.0f / l : 0.0f;
      for (std::int64_t dd = 0; dd < D; ++dd) dt::store<DT>(dst, dd, orow[dd] * inv);
      if (a.lse) {
        const double lse2 = static_cast<double>(mrun[r]) + std::log2(static_cast<double>(l));
        a.lse[(b * a.n + i) * a.hq + head] = seen ? static_cast<float>(lse2 * 0.6931471805599453) : -INFINITY;
      }
    }
  }
}

#if DSPEC_AVX512_CODE
// store_rows for float32 / bfloat16 outputs on 16 lanes, bit for bit: the same sequential
// lane sums (16 rows at a time, transposed so that each row's sum runs down one lane in the
// scalar order), the same float32 divide and multiply, dt::float_to_bf16's rounding.
template <int DT>
DSPEC_AVX512 void store_rows_avx512(const CascadeAttentionArgs& a, const Geometry& g, const float* o, const float* mrun,
                                    const float* lrun, std::int64_t b, std::int64_t kvh, std::int64_t i0,
                                    std::int64_t i1) {
  using T = dt::elem_t<DT>;
  T* out = static_cast<T*>(a.out);
  const std::int64_t D = a.head_dim, G = g.group, M = (i1 - i0) * G;
  alignas(64) float sums[16], invs[16];
  for (std::int64_t r0 = 0; r0 < M; r0 += 16) {
    const int rows = static_cast<int>(std::min<std::int64_t>(16, M - r0));
    __m512 t[16];
    for (int j = 0; j < 16; ++j) t[j] = j < rows ? _mm512_loadu_ps(lrun + (r0 + j) * 16) : _mm512_setzero_ps();
    transpose16(t);  // t[lane] holds that lane of the 16 rows
    __m512 l = _mm512_setzero_ps();
    for (int lane = 0; lane < 16; ++lane) l = _mm512_add_ps(l, t[lane]);
    const __mmask16 seen = _mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_store_ps(sums, l);
    _mm512_store_ps(invs, _mm512_maskz_div_ps(seen, _mm512_set1_ps(1.0f), l));
    for (int j = 0; j < rows; ++j) {
      const std::int64_t r = r0 + j, i = i0 + r / G, head = kvh * G + r % G;
      T* dst = out + b * a.out_stride[0] + i * a.out_stride[1] + head * a.out_stride[2];
      const float* orow = o + r * g.dp;
      const __m512 inv = _mm512_set1_ps(invs[j]);
      for (std::int64_t dd = 0; dd < D; dd += 16) {
        const __mmask16 m = lanes(D - dd);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, orow + dd), inv);
        if constexpr (DT == kFloat32) {
          _mm512_mask_storeu_ps(dst + dd, m, v);
        } else {
          _mm256_mask_storeu_epi16(dst + dd, m, _mm512_cvtepi32_epi16(cpu::bf16_bits(v)));
        }
      }
      if (a.lse) {
        const float lj = sums[j];
        const double lse2 = static_cast<double>(mrun[r]) + std::log2(static_cast<double>(lj));
        a.lse[(b * a.n + i) * a.hq + head] = lj > 0.0f ? static_cast<float>(lse2 * 0.6931471805599453) : -INFINITY;
      }
    }
  }
}
#endif

// Whether query row i of request b sees at least one key: a prefix row, or a suffix key
// its mask row lets it see (every suffix key without a mask).
inline bool sees_a_key(const CascadeAttentionArgs& a, std::int64_t b, std::int64_t i, std::int64_t plen) {
  if (plen > 0 || a.mask == nullptr) return plen > 0 || a.n > 0;
  const std::int32_t* row = a.mask + b * a.mask_stride[0] + i * a.mask_stride[1];
  const std::int64_t words = (a.n + 31) / 32;
  for (std::int64_t w = 0; w < words; ++w) {
    const std::int64_t keys = std::min<std::int64_t>(32, a.n - 32 * w);
    const std::uint32_t valid = keys == 32 ? 0xffffffffu : ((1u << keys) - 1u);
    if ((static_cast<std::uint32_t>(row[w]) & valid) != 0) return true;
  }
  return false;
}

// A NaN in a query row makes every score of that row NaN: the row's out and lse are NaN
// (IEEE semantics, as the torch reference gives), unless the row sees no key at all (out
// 0, lse -inf as for any such row).  The tile code treats NaN scores as -inf (its exp2
// maps NaN to 0), so the rows are found here, from q, and overwritten after the store.
template <int DT>
void store_nan_queries(const CascadeAttentionArgs& a, const Geometry& g, const Unit& u, std::int64_t H) {
  using T = dt::elem_t<DT>;
  const T* q = static_cast<const T*>(a.q);
  T* out = static_cast<T*>(a.out);
  const std::int64_t D = a.head_dim, G = g.group;
  for (std::int64_t i = u.i0; i < u.i1; ++i) {
    for (std::int64_t head = u.h0 * G; head < (u.h0 + H) * G; ++head) {
      const T* src = q + u.b * a.q_stride[0] + i * a.q_stride[1] + head * a.q_stride[2];
      bool nan = false;
      for (std::int64_t dd = 0; dd < D && !nan; ++dd) nan = std::isnan(dt::to_float<DT>(src[dd]));
      if (!nan || !sees_a_key(a, u.b, i, u.plen)) continue;
      T* dst = out + u.b * a.out_stride[0] + i * a.out_stride[1] + head * a.out_stride[2];
      for (std::int64_t dd = 0; dd < D; ++dd) dt::store<DT>(dst, dd, NAN);
      if (a.lse) a.lse[(u.b * a.n + i) * a.hq + head] = NAN;
    }
  }
}

void store_nan_rows(const CascadeAttentionArgs& a, const Geometry& g, const Unit& u, std::int64_t H) {
  switch (a.dtype) {
    case kFloat16: store_nan_queries<kFloat16>(a, g, u, H); break;
    case kBFloat16: store_nan_queries<kBFloat16>(a, g, u, H); break;
    default: store_nan_queries<kFloat32>(a, g, u, H); break;
  }
}

void store_state_rows(const CascadeAttentionArgs& a, const Geometry& g, const Workspace& ws, const Unit& u,
                      std::int64_t H, bool folded);

void store_state(const CascadeAttentionArgs& a, const Geometry& g, const Workspace& ws, const Unit& u, std::int64_t H,
                 bool folded) {
  store_state_rows(a, g, ws, u, H, folded);
  store_nan_rows(a, g, u, H);
}

void store_state_rows(const CascadeAttentionArgs& a, const Geometry& g, const Workspace& ws, const Unit& u,
                      std::int64_t H, bool folded) {
#if DSPEC_AVX512_CODE
  if (a.dtype != kFloat16 && cpu::has_avx512()) {
    for (std::int64_t hi = 0; hi < H; ++hi) {
      const HeadState st = folded ? ws.acc_state(hi) : ws.chunk_state(hi);
      if (a.dtype == kBFloat16) {
        store_rows_avx512<kBFloat16>(a, g, st.o, st.m, st.l, u.b, u.h0 + hi, u.i0, u.i1);
      } else {
        store_rows_avx512<kFloat32>(a, g, st.o, st.m, st.l, u.b, u.h0 + hi, u.i0, u.i1);
      }
    }
    return;
  }
#endif
  for (std::int64_t hi = 0; hi < H; ++hi) {
    const HeadState st = folded ? ws.acc_state(hi) : ws.chunk_state(hi);
    switch (a.dtype) {
      case kFloat16: store_rows<kFloat16>(a, g, st.o, st.m, st.l, u.b, u.h0 + hi, u.i0, u.i1); break;
      case kBFloat16: store_rows<kBFloat16>(a, g, st.o, st.m, st.l, u.b, u.h0 + hi, u.i0, u.i1); break;
      default: store_rows<kFloat32>(a, g, st.o, st.m, st.l, u.b, u.h0 + hi, u.i0, u.i1); break;
    }
  }
}

// acc <- fold(acc, chunk) for M rows: m = max(m_acc, m_c), O = 2^(m_acc - m) O_acc +
// 2^(m_c - m) O_c, likewise each of the 16 sum lanes.  An empty side (m = -inf: the row saw
// no key there) leaves the other side as it is, bit for bit.  One compiled copy (noinline):
// the sequential and the split paths must round alike.
#if DSPEC_AVX512_CODE
// One row of fold_state on 16 lanes, the scalar loop's bits: separate multiplies and an add
// (the scalar code has no FMA in the baseline target; the _round_ forms keep GCC from
// contracting them into one, as it would _mm512_mul_ps + _mm512_add_ps).
DSPEC_AVX512_INLINE __m512 fold_lanes(__m512 va, __m512 acc, __m512 vc, __m512 chunk) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm512_add_round_ps(_mm512_mul_round_ps(va, acc, kRne), _mm512_mul_round_ps(vc, chunk, kRne), kRne);
}

DSPEC_AVX512 void fold_row_avx512(float* o, const float* x, float* l, const float* y, float fa, float fc,
                                  std::int64_t DP) {
  const __m512 va = _mm512_set1_ps(fa), vc = _mm512_set1_ps(fc);
  for (std::int64_t dd = 0; dd < DP; dd += 16) {
    _mm512_storeu_ps(o + dd, fold_lanes(va, _mm512_loadu_ps(o + dd), vc, _mm512_loadu_ps(x + dd)));
  }
  _mm512_storeu_ps(l, fold_lanes(va, _mm512_loadu_ps(l), vc, _mm512_loadu_ps(y)));
}
#endif

__attribute__((noinline)) void fold_state(HeadState acc, const float* oc, const float* mc, const float* lc,
                                          std::int64_t M, std::int64_t DP) {
#if DSPEC_AVX512_CODE
  const bool avx512 = cpu::has_avx512();
#endif
  for (std::int64_t r = 0; r < M; ++r) {
    if (mc[r] == -INFINITY) continue;
    if (acc.m[r] == -INFINITY) {
      std::copy(oc + r * DP, oc + (r + 1) * DP, acc.o + r * DP);
      std::copy(lc + r * 16, lc + (r + 1) * 16, acc.l + r * 16);
      acc.m[r] = mc[r];
      continue;
    }
    const float nm = std::max(acc.m[r], mc[r]);
    const float fa = std::exp2(acc.m[r] - nm), fc = std::exp2(mc[r] - nm);
#if DSPEC_AVX512_CODE
    if (avx512) {
      fold_row_avx512(acc.o + r * DP, oc + r * DP, acc.l + r * 16, lc + r * 16, fa, fc, DP);
      acc.m[r] = nm;
      continue;
    }
#endif
    float* o = acc.o + r * DP;
    const float* x = oc + r * DP;
    for (std::int64_t dd = 0; dd < DP; ++dd) o[dd] = fa * o[dd] + fc * x[dd];
    float* l = acc.l + r * 16;
    const float* y = lc + r * 16;
    for (int lane = 0; lane < 16; ++lane) l[lane] = fa * l[lane] + fc * y[lane];
    acc.m[r] = nm;
  }
}

void reset_state(HeadState st, std::int64_t M, std::int64_t DP) {
  std::fill(st.o, st.o + M * DP, 0.0f);
  std::fill(st.m, st.m + M, -INFINITY);
  std::fill(st.l, st.l + M * 16, 0.0f);
}

// A split unit keeps the state of each chunk it ran in the chunk's scratch slot; the unit
// that finishes the group's last chunk folds the states in chunk order and stores the rows.
inline float* chunk_slot(const SplitState& split, const Unit& u, int c, std::int64_t hi) {
  return split.mem + (u.slot0 + c) * split.slot_floats + hi * split.head_floats;
}

void keep_chunk(const Geometry& g, const Workspace& ws, const Unit& u, int c, std::int64_t H, std::int64_t M,
                const SplitState& split) {
  const std::int64_t DP = g.dp;
  for (std::int64_t hi = 0; hi < H; ++hi) {
    const HeadState st = ws.chunk_state(hi);
    float* dst = chunk_slot(split, u, c, hi);
    std::copy(st.o, st.o + M * DP, dst);
    std::copy(st.m, st.m + M, dst + M * DP);
    std::copy(st.l, st.l + M * 16, dst + M * DP + M);
  }
}

void finish_split(const CascadeAttentionArgs& a, const Geometry& g, Workspace& ws, const Unit& u, std::int64_t H,
                  std::int64_t M, const SplitState& split) {
  const std::int64_t DP = g.dp;
  const int ran = u.c1 - u.c0;
  if (split.done[u.merge].fetch_add(ran, std::memory_order_acq_rel) != u.chunks - ran) return;
  for (std::int64_t hi = 0; hi < H; ++hi) {
    const HeadState acc = ws.acc_state(hi);
    reset_state(acc, M, DP);
    for (int c = 0; c < u.chunks; ++c) {
      const float* st = chunk_slot(split, u, c, hi);
      fold_state(acc, st, st + M * DP, st + M * DP + M, M, DP);
    }
  }
  store_state(a, g, ws, u, H, true);
}

// Suffix mask bits js .. js + count - 1 (count <= 64) of a packed row of `words` words.
inline std::uint64_t suffix_bits(const std::int32_t* row, std::int64_t js, int count, std::int64_t words) {
  const std::int64_t w0 = js / 32;
  const int sh = static_cast<int>(js % 32);
  auto word = [&](std::int64_t w) -> std::uint64_t {
    return w < words ? static_cast<std::uint64_t>(static_cast<std::uint32_t>(row[w])) : 0;
  };
  std::uint64_t bits = (word(w0) | (word(w0 + 1) << 32)) >> sh;
  if (sh) bits |= word(w0 + 2) << (64 - sh);
  return count >= 64 ? bits : bits & ((std::uint64_t(1) << count) - 1);
}

// The unit's tokens [i0, i1) whose visible suffix keys (mask row of n bits in `words`
// words) are not 1..1 0..0: their entries in ws.odd_of / ws.odd / ws.keys.  Returns how many.
std::int64_t find_compacted(const std::int32_t* mb, std::int64_t row_stride, std::int64_t words, std::int64_t n,
                            std::int64_t i0, std::int64_t i1, Workspace& ws) {
  // word w of a mask row, its bits past n cleared; all_ones: the word's bits below n
  auto word = [&](const std::int32_t* row, std::int64_t w, std::uint64_t& all_ones) {
    const int valid = static_cast<int>(std::min<std::int64_t>(32, n - 32 * w));
    all_ones = (std::uint64_t(1) << valid) - 1;
    return static_cast<std::uint32_t>(row[w]) & all_ones;
  };
  std::int64_t count = 0, used = 0;
  for (std::int64_t i = i0; i < i1; ++i) {
    const std::int32_t* row = mb + i * row_stride;
    bool regular = true, ended = false;
    for (std::int64_t w = 0; w < words && regular; ++w) {
      std::uint64_t all_ones;
      const std::uint64_t x = word(row, w, all_ones);
      if (ended ? x != 0 : (x & (x + 1)) != 0) regular = false;  // a one after a zero
      if (x != all_ones) ended = true;
    }
    ws.odd_of[i - i0] = regular ? -1 : static_cast<std::int32_t>(count);
    if (regular) continue;
    std::int64_t k = 0;
    for (std::int64_t w = 0; w < words; ++w) {
      std::uint64_t all_ones;
      for (std::uint64_t x = word(row, w, all_ones); x; x &= x - 1)
        ws.keys[used + k++] = static_cast<std::int32_t>(32 * w + __builtin_ctzll(x));
    }
    ws.odd[3 * count] = i - i0;
    ws.odd[3 * count + 1] = used;
    ws.odd[3 * count + 2] = k;
    used += k;
    ++count;
  }
  return count;
}

// One work unit: request b, KV heads [h0, h0 + H), query tokens [i0, i1), key chunks
// [c0, c1).  Key tiles are the outer loop and the heads the inner one, so the unit reads
// each K / V row (all its heads side by side in memory) once, in order.
void run_unit_tiles(const CascadeAttentionArgs& a, const Ops& ops, const Geometry& g, Workspace& ws, const Unit& u,
                    const SplitState& split) {
  const std::int64_t b = u.b, h0 = u.h0, i0 = u.i0, i1 = u.i1;
  const std::int64_t H = std::min(g.group_heads, a.hkv - h0);
  if (i0 >= i1 || H <= 0) return;
  const std::int64_t G = g.group, DP = g.dp, D = a.head_dim, M = (i1 - i0) * G, item = g.item;
  const std::int64_t qo_stride = ws.rows * DP, st_stride = up16(ws.rows);  // per head
  const std::int64_t plen = u.plen, total = plen + a.n;
  // fp32 V rows with D % 16 == 0 are read in place by small tiles and for D <= 64; larger
  // ones copy the V tile (64 rows of up to 4 KiB apart) into L1-friendly contiguous rows
  const bool v_in_place = a.dtype == kFloat32 && DP == D && (M < 16 || D <= 64);
  constexpr int KT = kKeyTile;

  for (std::int64_t hi = 0; hi < H; ++hi) {
    float* qp = ws.qp + hi * qo_stride;
    switch (a.dtype) {
      case kFloat16: load_q_rows<kFloat16>(a, g, b, h0 + hi, i0, i1, qp); break;
      case kBFloat16: load_q_rows<kBFloat16>(a, g, b, h0 + hi, i0, i1, qp); break;
      default: load_q_rows<kFloat32>(a, g, b, h0 + hi, i0, i1, qp); break;
    }
    if (ops.prepare_q != nullptr) ops.prepare_q(qp, M, DP);
  }

  // key rows: the prefix (ragged rows or pages) below plen, the suffix from plen on; per
  // head, prefix rows are dkp / dvp bytes apart, suffix rows dks / dvs
  const char* pk = static_cast<const char*>(a.prefix_k);
  const char* pv = static_cast<const char*>(a.prefix_v);
  const std::int64_t kr = a.prefix_k_stride[1], vr = a.prefix_v_stride[1];
  const std::int64_t kh0 = h0 * a.prefix_k_stride[2], vh0 = h0 * a.prefix_v_stride[2];
  const std::int64_t dkp = a.prefix_k_stride[2] * item, dvp = a.prefix_v_stride[2] * item;
  const bool ragged = a.prefix == kPrefixRagged;
  const std::int64_t row0 = ragged ? index_at(a.prefix_indptr, a.indptr_dtype, b) : 0;
  const std::int32_t* table = a.prefix == kPrefixPaged ? a.page_table + b * a.page_table_stride : nullptr;
  const char* kb = static_cast<const char*>(a.k) + (b * a.k_stride[0] + h0 * a.k_stride[2]) * item;
  const char* vb = static_cast<const char*>(a.v) + (b * a.v_stride[0] + h0 * a.v_stride[2]) * item;
  const std::int64_t dks = a.k_stride[2] * item, dvs = a.v_stride[2] * item;
  // the rows of suffix key js (first head of the unit)
  auto suffix_k = [&](std::int64_t js) { return kb + js * a.k_stride[1] * item; };
  auto suffix_v = [&](std::int64_t js) { return vb + js * a.v_stride[1] * item; };
  // addresses of the kt rows of the tile at key t0; returns how many are prefix rows
  auto fill = [&](std::int64_t t0, int kt, const char** kd, const char** vd) {
    const int np = static_cast<int>(std::clamp<std::int64_t>(plen - t0, 0, kt));
    if (ragged) {
      for (int j = 0; j < np; ++j) {
        const std::int64_t row = row0 + t0 + j;
        kd[j] = pk + (row * kr + kh0) * item;
        vd[j] = pv + (row * vr + vh0) * item;
      }
    } else if (np > 0) {
      std::int64_t page_i = t0 / a.page_size, slot = t0 % a.page_size;
      for (int j = 0; j < np; ++j) {
        const std::int64_t page = table[page_i];
        kd[j] = pk + (page * a.prefix_k_stride[0] + slot * kr + kh0) * item;
        vd[j] = pv + (page * a.prefix_v_stride[0] + slot * vr + vh0) * item;
        if (++slot == a.page_size) {
          slot = 0;
          ++page_i;
        }
      }
    }
    for (int j = np; j < kt; ++j) {
      kd[j] = suffix_k(t0 + j - plen);
      vd[j] = suffix_v(t0 + j - plen);
    }
    return np;
  };

  const void* kh[kKeyTile];
  const void* vh[kKeyTile];
  const float* vrows[kKeyTile];
  const std::int32_t* mb = a.mask ? a.mask + b * a.mask_stride[0] : nullptr;
  // one tile for every head of the unit, rows [r0, r0 + m): key rows j < np from the
  // prefix, the rest the suffix
  auto tile = [&](int kt, int np, const char* const* kr_, const char* const* vr_, const std::uint64_t* bits,
                  std::int64_t r0, std::int64_t m) {
    const int nv = (kt + 15) / 16;
    for (std::int64_t hi = 0; hi < H; ++hi) {
      for (int j = 0; j < kt; ++j) {
        kh[j] = kr_[j] + hi * (j < np ? dkp : dks);
        vh[j] = vr_[j] + hi * (j < np ? dvp : dvs);
      }
      if (v_in_place) {
        for (int j = 0; j < kt; ++j) vrows[j] = static_cast<const float*>(vh[j]);
      } else {
        ops.pack_v(vh, kt, a.dtype, D, DP, ws.vt);
        for (int j = 0; j < kt; ++j) vrows[j] = ws.vt + j * DP;
      }
      const HeadState st = ws.chunk_state(hi);
      ops.pack_k(kh, kt, a.dtype, D, DP, ws.kt);
      float* alpha = ws.alpha + hi * st_stride + r0;
      ops.qk(ws.qp + hi * qo_stride + r0 * DP, m, DP, ws.kt, nv, ws.s, g.s_scale);
      ops.softmax(ws.s, m, kt, nv, bits, st.m + r0, st.l + r0 * 16, alpha);
      ops.pv(ws.s, m, kt, vrows, DP, alpha, st.o + r0 * DP);
    }
  };
  const std::int64_t n_odd = mb ? find_compacted(mb, a.mask_stride[1], g.words, a.n, i0, i1, ws) : 0;
  const char* odd_k[kKeyTile];
  const char* odd_v[kKeyTile];
  // the tile at key t0 (np prefix rows) of each compacted token: the prefix rows, then its
  // visible suffix keys number t0 + np - plen on, as many as fit; the rest of the kt rows
  // point at suffix key 0, masked (an exact zero, as a short tile's missing keys)
  auto compacted_tiles = [&](std::int64_t t0, int kt, int np, const char* const* pk_, const char* const* pv_) {
    const std::int64_t s0 = t0 + np - plen;
    for (std::int64_t e = 0; e < n_odd; ++e) {
      const std::int64_t rel = ws.odd[3 * e], first = ws.odd[3 * e + 1], count = ws.odd[3 * e + 2];
      const int cnt = static_cast<int>(std::clamp<std::int64_t>(count - s0, 0, kt - np));
      if (np + cnt == 0) continue;
      for (int j = 0; j < np; ++j) {
        odd_k[j] = pk_[j];
        odd_v[j] = pv_[j];
      }
      for (int j = np; j < kt; ++j) {
        const std::int64_t js = j < np + cnt ? ws.keys[first + s0 + (j - np)] : 0;
        odd_k[j] = suffix_k(js);
        odd_v[j] = suffix_v(js);
      }
      // its rows' bits (zero in the shared tile just run): the first np + cnt keys
      std::uint64_t* bits = ws.bits.data() + rel * G;
      const std::uint64_t w = np + cnt >= 64 ? ~std::uint64_t(0) : (std::uint64_t(1) << (np + cnt)) - 1;
      for (std::int64_t h = 0; h < G; ++h) bits[h] = w;
      tile(kt, np, odd_k, odd_v, bits, rel * G, G);
    }
  };

  // The next tile's K / V rows (every head of the unit) are prefetched while this one is
  // computed: a decode step reads each layer's cached rows once, from DRAM, and a tile's
  // rows (64 rows ~100-400 B long, a few KiB apart per head) are too short a stream for the
  // hardware prefetcher (measured: ~5 GB/s from DRAM without, SmolLM2 at 2048 cached tokens).
  const char* ka[kKeyTile];
  const char* va[kKeyTile];
  const char* kq[kKeyTile];
  const char* vq[kKeyTile];
  const std::int64_t k_span = (H - 1) * dkp + D * item, v_span = (H - 1) * dvp + D * item;  // prefix rows

  const bool folded = u.merge < 0 && u.chunks > 1;  // a sequential unit of several chunks
  if (folded) {
    for (std::int64_t hi = 0; hi < H; ++hi) reset_state(ws.acc_state(hi), M, DP);
  }
  for (int c = u.c0; c < u.c1; ++c) {
    for (std::int64_t hi = 0; hi < H; ++hi) reset_state(ws.chunk_state(hi), M, DP);
    const std::int64_t k0 = static_cast<std::int64_t>(c) * kSplitKeys;
    const std::int64_t k1 = std::min(total, k0 + kSplitKeys);
    const char** cur_k = ka;
    const char** cur_v = va;
    const char** next_k = kq;
    const char** next_v = vq;
    int kt = static_cast<int>(std::min<std::int64_t>(KT, k1 - k0));
    int np = fill(k0, kt, cur_k, cur_v);
    for (std::int64_t t0 = k0; t0 < k1; t0 += KT) {
      const int kn = static_cast<int>(std::min<std::int64_t>(KT, std::max<std::int64_t>(0, k1 - t0 - KT)));
      int np_next = 0;
      if (kn > 0) {
        np_next = fill(t0 + KT, kn, next_k, next_v);
        for (int j = 0; j < np_next; ++j) {
          for (std::int64_t off = 0; off < k_span; off += 64) __builtin_prefetch(next_k[j] + off, 0, 3);
          for (std::int64_t off = 0; off < v_span; off += 64) __builtin_prefetch(next_v[j] + off, 0, 3);
        }
      }
      const std::uint64_t* bits = nullptr;
      bool run = true;
      if (mb && np < kt) {
        // the rows' mask bits of the tile's suffix keys, above its (visible) prefix rows
        const std::int64_t js = t0 + np - plen;
        const std::uint64_t prefix_bits = np == 0 ? 0 : (std::uint64_t(1) << np) - 1;
        std::uint64_t any = 0;
        for (std::int64_t i = i0; i < i1; ++i) {
          std::uint64_t w = 0;  // a compacted token runs this tile on its own keys
          if (ws.odd_of[i - i0] < 0)
            w = prefix_bits | (suffix_bits(mb + i * a.mask_stride[1], js, kt - np, g.words) << np);
          any |= w;
          for (std::int64_t h = 0; h < G; ++h) ws.bits[(i - i0) * G + h] = w;
        }
        run = any != 0;  // a tile no row sees changes no state: skipped
        bits = ws.bits.data();
      }
      if (run) tile(kt, np, cur_k, cur_v, bits, 0, M);
      if (n_odd > 0 && np < kt) compacted_tiles(t0, kt, np, cur_k, cur_v);
      std::swap(cur_k, next_k);
      std::swap(cur_v, next_v);
      kt = kn;
      np = np_next;
    }
    if (u.merge >= 0) {
      keep_chunk(g, ws, u, c, H, M, split);
      continue;
    }
    if (folded) {
      for (std::int64_t hi = 0; hi < H; ++hi) {
        const HeadState st = ws.chunk_state(hi);
        fold_state(ws.acc_state(hi), st.o, st.m, st.l, M, DP);
      }
    }
  }
  if (u.merge >= 0) {
    finish_split(a, g, ws, u, H, M, split);
    return;
  }
  store_state(a, g, ws, u, H, folded);
}

// One unit; its AMX tiles (if any) are released at its end.
void run_unit(const CascadeAttentionArgs& a, const Ops& ops, const Geometry& g, Workspace& ws, const Unit& u,
              const SplitState& split) {
  run_unit_tiles(a, ops, g, ws, u, split);
#if DSPEC_AVX512_CODE && DSPEC_AMX_CODE
  amx_unit_end();
#endif
}

const Ops& pick_ops(const CascadeAttentionArgs& a) {
#if DSPEC_AVX512_CODE
#if DSPEC_AMX_CODE
  if ((a.isa == kIsaAuto || a.isa == kIsaAmx) && cascade_attention_has_amx(a.dtype, a.head_dim)) return kAmxOps;
#endif
  if (a.isa != kIsaGeneric && a.isa != kIsaAvx2 && cascade_attention_has_avx512()) return kAvx512Ops;
#endif
#if DSPEC_CA_HAS_AVX2
  if (a.isa != kIsaGeneric && cpu::has_avx2()) return kAvx2Ops;
#endif
  (void)a;
  return kGenericOps;
}

}  // namespace

bool cascade_attention_has_avx512() {
#if DSPEC_AVX512_CODE
  return cpu::has_avx512();
#else
  return false;
#endif
}

bool cascade_attention_has_amx(int dtype, std::int64_t head_dim) {
#if DSPEC_AVX512_CODE && DSPEC_AMX_CODE
  return dtype == kBFloat16 && head_dim % 32 == 0 && head_dim <= 512 && cpu::has_amx_bf16();
#else
  (void)dtype;
  (void)head_dim;
  return false;
#endif
}

void cascade_attention_cpu(const CascadeAttentionArgs& a) {
  if (a.batch <= 0 || a.n <= 0) return;
  const Ops& ops = pick_ops(a);
  Geometry g;
  g.group = a.hq / a.hkv;
  g.dp = (a.head_dim + 15) / 16 * 16;
  g.item = a.dtype == kFloat32 ? 4 : 2;
  g.words = (a.n + 31) / 32;
  g.scale2 = static_cast<float>(static_cast<double>(a.sm_scale) * 1.4426950408889634);
  g.q_scale = ops.unscaled_q ? 1.0f : g.scale2;
  g.s_scale = ops.unscaled_q ? g.scale2 : 1.0f;

  // threads: by the work (the suffix counted dense) and by the prefix bytes read
  auto chunks_of = [&](std::int64_t plen) {  // chunks of the request's P + N keys
    return static_cast<int>(std::max<std::int64_t>(1, (plen + a.n + kSplitKeys - 1) / kSplitKeys));
  };
  // full chunks only, for balancing: a short last chunk is not worth a unit of its own
  std::int64_t prefix_rows = 0, chunks_total = 0;
  std::vector<std::int64_t> plens(static_cast<std::size_t>(a.batch));
  for (std::int64_t b = 0; b < a.batch; ++b) {
    plens[b] = prefix_length(a, b);
    prefix_rows += plens[b];
    chunks_total += std::max<std::int64_t>(1, (plens[b] + a.n) / kSplitKeys);
  }
  const double flops = 4.0 * static_cast<double>(a.hq) * static_cast<double>(a.head_dim) * static_cast<double>(a.n) *
                       (static_cast<double>(prefix_rows) + static_cast<double>(a.batch) * static_cast<double>(a.n));
  const double bytes = 2.0 * static_cast<double>(prefix_rows) * static_cast<double>(a.hkv) *
                       static_cast<double>(a.head_dim) * static_cast<double>(g.item);
  std::int64_t threads = 1;
  if (a.num_threads > 1 && (flops >= kMinParallelFlops || bytes >= kMinParallelBytes)) {
    const double want = std::max(flops / kFlopsPerThread, bytes / kBytesPerThread);
    threads = std::min<std::int64_t>(
        {a.num_threads, static_cast<std::int64_t>(cpu::max_threads()), static_cast<std::int64_t>(want)});
    threads = std::max<std::int64_t>(threads, 1);
  }
  // units: (request, KV head group, query tile[, key chunk]).  One group of every head and
  // query tiles of at most kMaxTileRows rows, then, while threads would idle, more head
  // groups and more query tiles.
  std::int64_t q_tiles = std::min(a.n, (a.n * g.group + kMaxTileRows - 1) / kMaxTileRows);
  // as many heads per unit as keep their Q and O rows within kUnitStateBytes (L2): the unit
  // then streams whole K / V rows (every head side by side) once
  const std::int64_t head_state = (a.n + q_tiles - 1) / q_tiles * g.group * g.dp * 8;
  const std::int64_t unit_heads =
      std::max<std::int64_t>(1, std::min<std::int64_t>(a.hkv, kUnitStateBytes / head_state));
  std::int64_t head_groups = (a.hkv + unit_heads - 1) / unit_heads;
  while (threads > 1 && chunks_total * head_groups * q_tiles < 2 * threads) {
    if (head_groups < a.hkv) {
      ++head_groups;
    } else if (q_tiles < a.n) {
      ++q_tiles;
    } else {
      break;
    }
  }
  g.group_heads = (a.hkv + head_groups - 1) / head_groups;
  g.head_groups = (a.hkv + g.group_heads - 1) / g.group_heads;
  g.tile_tokens = (a.n + q_tiles - 1) / q_tiles;
  g.q_tiles = (a.n + g.tile_tokens - 1) / g.tile_tokens;
  const std::int64_t rows = g.tile_tokens * g.group;

  // the unit list: split into one unit per chunk (merge counters, scratch slots) only while
  // the (request, head group, query tile) units alone would leave threads idle
  const bool split_k = threads > 1 && a.batch * g.head_groups * g.q_tiles < 2 * threads;
  static thread_local std::vector<Unit> units;
  units.clear();
  std::int64_t merges = 0, slots = 0;
  for (std::int64_t b = 0; b < a.batch; ++b) {
    for (std::int64_t hg = 0; hg < g.head_groups; ++hg) {
      for (std::int64_t qt = 0; qt < g.q_tiles; ++qt) {
        Unit u;
        u.b = b;
        u.h0 = hg * g.group_heads;
        u.i0 = qt * g.tile_tokens;
        u.i1 = std::min(a.n, u.i0 + g.tile_tokens);
        u.plen = plens[b];
        u.chunks = chunks_of(u.plen);
        u.c1 = u.chunks;
        if (!split_k || u.chunks == 1) {
          units.push_back(u);
          continue;
        }
        u.merge = merges++;
        u.slot0 = slots;
        slots += u.chunks;
        // a short last chunk (the suffix after a full one, typically) rides with the chunk
        // before it: a unit of its own would cost more than its keys
        const std::int64_t last = u.plen + a.n - static_cast<std::int64_t>(u.chunks - 1) * kSplitKeys;
        const int units_of = last < kSplitKeys / 2 ? u.chunks - 1 : u.chunks;
        for (int c = 0; c < units_of; ++c) {
          u.c0 = c;
          u.c1 = c + 1 == units_of ? u.chunks : c + 1;
          units.push_back(u);
        }
      }
    }
  }
  static thread_local std::vector<float> scratch;
  SplitState split;
  split.head_floats = rows * (g.dp + 17);
  split.slot_floats = g.group_heads * split.head_floats;
  if (slots > 0 && static_cast<std::int64_t>(scratch.size()) < slots * split.slot_floats)
    scratch.resize(static_cast<std::size_t>(slots * split.slot_floats));
  split.mem = scratch.data();
  std::unique_ptr<std::atomic<int>[]> done(merges > 0 ? new std::atomic<int>[merges] : nullptr);
  for (std::int64_t i = 0; i < merges; ++i) done[i].store(0, std::memory_order_relaxed);
  split.done = done.get();

  const std::int64_t count = static_cast<std::int64_t>(units.size());
  threads = std::min(threads, count);
  if (threads > 1) {
    // the costliest units first (the threads take them in list order): a split unit that
    // also holds the short last chunk, or a query tile late in the causal suffix, costs more
    // than the others, and in list order it could start last and leave the other threads
    // idle (the bf16 N = 64 prefix 512 case: 14 % of its samples in idle workers).  The
    // results do not depend on the order (fixed chunks, folded in chunk order).
    const auto cost = [&](const Unit& u) {
      const std::int64_t k0 = static_cast<std::int64_t>(u.c0) * kSplitKeys;
      const std::int64_t k1 = std::min(u.plen + u.i1, static_cast<std::int64_t>(u.c1) * kSplitKeys);
      return std::max<std::int64_t>(k1 - k0, 1) * (u.i1 - u.i0);
    };
    std::stable_sort(units.begin(), units.end(), [&](const Unit& x, const Unit& y) { return cost(x) > cost(y); });
  }
  static thread_local Workspace local;
  local.reserve(rows, g.dp, g.group_heads);
  if (a.mask) local.reserve_compacted(g.tile_tokens, a.n);
  if (threads <= 1) {
    for (const Unit& u : units) run_unit(a, ops, g, local, u, split);
    return;
  }
  // workspaces reserved here, so that no worker thread can fail to allocate
  static thread_local std::vector<Workspace> extra;
  if (static_cast<std::int64_t>(extra.size()) < threads - 1) extra.resize(static_cast<std::size_t>(threads - 1));
  for (std::int64_t t = 0; t < threads - 1; ++t) {
    extra[t].reserve(rows, g.dp, g.group_heads);
    if (a.mask) extra[t].reserve_compacted(g.tile_tokens, a.n);
  }
  // thread_local names resolve per thread: the workers get this thread's objects by address
  std::atomic<std::int64_t> next{0};
  Workspace* const callers = &local;  // chunk 0's: any thread may run any chunk
  Workspace* const others = extra.data();
  const Unit* const list = units.data();
  cpu::parallel_for(static_cast<int>(threads), [&](int t) {
    Workspace& ws = t == 0 ? *callers : others[t - 1];
    for (std::int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) run_unit(a, ops, g, ws, list[i], split);
  });
}

}  // namespace dspec
