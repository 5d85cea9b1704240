// Small-row linear layer on the CPU; see linear.h.
//
// The weight is packed once (linear_pack_cpu) into panels of kPanel = 16 output columns,
// S = 2 elements along k per lane for 16-bit dtypes (k pairs, the operand layout of
// AVX512_BF16's vdpbf16ps) and S = 1 for float32, zero padded.  Panels come in groups of
// kPanelBlock = 4 (fewer in the last group), interleaved by k step: group g holds, for each
// step s, its tp panels' [16][S] blocks back to back, so a tile of the group's panels reads
// one sequential stream (tp separate panel streams measured slower: the prefetchers ramp
// up on each short stream).  A tile keeps MR (<= 6) rows x T (<= 4) panels of float32
// accumulators in registers; each k step loads T panel vectors and broadcasts one k pair
// (or element) of each row: no reduction across lanes at the end, so a few rows run near
// the FMA peak and one row streams the weight.  Threads split the groups (each weight byte
// read once).
// (Balanced tiles of up to 8 rows x 3 panels measured no faster at 16 rows and ~15 %
// slower at 8: bench_linear A/B, AMD EPYC, November 2026.)
//
// On a CPU with AMX-BF16 the bf16 tiles run on the tile unit instead: the same packed panel
// is exactly an AMX B operand (16 k pairs of 16 columns, 64 bytes a row; a group's panels
// sit at a row stride of tp * 64 bytes), so the layout serves both.  16-bit weights are
// padded along k to whole 32-element tile depths.  AMX sums a tile's k pairs in its own
// order (its bits differ from vdpbf16ps'), so where it is on, every row count takes it:
// a row's bits still never depend on the other rows or the thread split.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_amx.h"
#include "cpu_avx512.h"
#include "cpu_features.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "dtype.h"
#include "linear.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DSPEC_LINEAR_X86 1
#define DSPEC_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,fma,avx512bf16")))
#else
#define DSPEC_LINEAR_X86 0
#endif

namespace dspec {
namespace {

constexpr int kRowBlock = 6;
constexpr int kPanelBlock = 4;
// below this many weight elements per thread a call stays on one thread
constexpr std::int64_t kElementsPerThread = std::int64_t(1) << 17;
// from this many rows a call's threads split the rows, not the weight (linear_group_cpu)
constexpr std::int64_t kRowSplitMinRows = 256;

constexpr int step_of(int dtype) { return dtype == kFloat32 ? 1 : 2; }
// k is padded to a multiple of this in the packed weight: one AMX tile depth (16 k pairs)
// for the 16-bit dtypes, one element for float32
constexpr int kTileDepth = 32;
constexpr std::int64_t padded_k(std::int64_t k, int dtype) {
  return dtype == kFloat32 ? k : (k + kTileDepth - 1) / kTileDepth * kTileDepth;
}

// One tile: rows [mr] of x times the tp panels of one group of the packed weight into
// out, plus bias.
struct Tile {
  const void* x;  // first row
  std::int64_t ldx;
  const void* w;  // the group's first element
  std::int64_t k;
  const float* bias;  // kPanel * tp floats (zeros where no bias)
  void* out;          // first row, first column of the first panel
  std::int64_t ldo;
  int last_cols;           // valid columns of the last panel, 1 .. 16
  int prefetch_steps;      // software prefetch distance along the group's stream, in k steps
  const void* stream_end;  // the end of this thread's panels: no prefetch at or past it
  // The AVX2 tiles run a call one k chunk at a time (all passes and row blocks of a chunk
  // while its weights sit in L1): k steps [s0, s1), accumulators carried between chunks in
  // acc (this row block's first row; row stride kPanel * kPanelBlock floats); first: they
  // start at 0, last: the chunk ends k and the tile stores out.
  std::int64_t s0 = 0, s1 = 0;
  float* acc = nullptr;
  bool first = true, last = true;
  // the next chunk's weight lines (null: none), prefetched by the first row block's
  // second-half pass, pf_lines per k step, up to pf_end
  const char* pf = nullptr;
  const char* pf_end = nullptr;
  int pf_lines = 0;
};

// The prefetch distance in k steps (x T cache lines of the stream); linear_prefetch_steps
// sets it.  It must cover the memory latency at the stream's rate (8 KB ahead at 32 steps
// of 4 panels), and stops at the thread's last panel.  SmolLM2-135M bf16 forwards after
// 256 tokens, one process, distances alternated over 10 rounds (AMD EPYC, 2 threads):
// 9 rows 8.33 ms at 8 steps, 7.95 at 16, 7.72 at 32; 16 rows 10.86 / 10.42 / 10.26; one
// row 5.28-5.33 ms at each.  (Without the stop, 32 steps cost one row ~3 % in one run:
// every chunk's tail fetched 8 KB of another thread's panels.  Prefetching into L2 instead,
// _MM_HINT_T1, measured slower at 32-128 steps.)
std::atomic<int> g_prefetch_steps{32};

using Micro = void (*)(const Tile&);

// ---------------------------------------------------------------------- portable code

// Per output column: a float32 sum over k in order (k pairs summed first for 16-bit
// dtypes), the same whatever rows the tile holds.
template <int DT, int MR, int T>
void micro_generic(const Tile& t) {
  using E = dt::elem_t<DT>;
  constexpr int S = step_of(DT);
  const E* x = static_cast<const E*>(t.x);
  const E* w = static_cast<const E*>(t.w);
  const std::int64_t steps = (t.k + S - 1) / S;
  for (int i = 0; i < MR; ++i) {
    const E* xr = x + i * t.ldx;
    for (int p = 0; p < T; ++p) {
      const int cols = p == T - 1 ? t.last_cols : kPanel;
      for (int c = 0; c < cols; ++c) {
        float acc = 0.0f;
        for (std::int64_t s = 0; s < steps; ++s) {
          const E* ws = w + ((s * T + p) * kPanel + c) * S;
          float pair = 0.0f;
          for (int e = 0; e < S; ++e) {
            const std::int64_t kk = s * S + e;
            if (kk < t.k) pair += dt::to_float<DT>(xr[kk]) * dt::to_float<DT>(ws[e]);
          }
          acc += pair;
        }
        dt::store<DT>(t.out, i * t.ldo + p * kPanel + c, acc + t.bias[p * kPanel + c]);
      }
    }
  }
}

// ---------------------------------------------------------------------- AVX-512 code

#if DSPEC_LINEAR_X86
// One k step for the two element types: the broadcast of a row's step, acc += x * w over
// it in 16 float32 lanes (one per output column), and the rounding store of 16 outputs.
struct Bf16Step {
  using E = std::uint16_t;
  static constexpr int kS = 2;
  DSPEC_AVX512BF16 static inline __m512i broadcast(const E* p) {
    std::int32_t pair;
    std::memcpy(&pair, p, sizeof(pair));
    return _mm512_set1_epi32(pair);
  }
  DSPEC_AVX512BF16 static inline __m512i broadcast_last(const E* p) {  // k odd: (x[k-1], 0)
    return _mm512_set1_epi32(static_cast<std::int32_t>(*p));
  }
  DSPEC_AVX512BF16 static inline __m512i load(const E* p) { return _mm512_loadu_si512(p); }
  DSPEC_AVX512BF16 static inline __m512 dot(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
  DSPEC_AVX512BF16 static inline void store(E* out, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(out, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
};

struct F32Step {
  using E = float;
  static constexpr int kS = 1;
  DSPEC_AVX512BF16 static inline __m512 broadcast(const E* p) { return _mm512_set1_ps(*p); }
  DSPEC_AVX512BF16 static inline __m512 broadcast_last(const E* p) { return _mm512_set1_ps(*p); }
  DSPEC_AVX512BF16 static inline __m512 load(const E* p) { return _mm512_loadu_ps(p); }
  DSPEC_AVX512BF16 static inline __m512 dot(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
  DSPEC_AVX512BF16 static inline void store(E* out, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(out, m, v); }
};

template <class S, int MR, int T, bool kLast>
DSPEC_AVX512BF16 inline __attribute__((always_inline)) void micro_step(__m512 (&acc)[MR][T], const typename S::E* x,
                                                                       std::int64_t ldx, const typename S::E* w,
                                                                       std::int64_t s, std::int64_t ahead,
                                                                       const typename S::E* end) {
  decltype(S::load(w)) wv[T];
  const typename S::E* ws = w + s * T * kPanel * S::kS;
  // past the group's end this touches the next group's start, which this thread reads next;
  // past the thread's last panel it would fetch another thread's (long consumed) bytes
  const bool fetch = ws + ahead < end;
#pragma GCC unroll 4
  for (int p = 0; p < T; ++p) {
    if (fetch) _mm_prefetch(reinterpret_cast<const char*>(ws + ahead + p * kPanel * S::kS), _MM_HINT_T0);
    wv[p] = S::load(ws + p * kPanel * S::kS);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const auto xb = kLast ? S::broadcast_last(x + i * ldx + s * S::kS) : S::broadcast(x + i * ldx + s * S::kS);
#pragma GCC unroll 4
    for (int p = 0; p < T; ++p) acc[i][p] = S::dot(acc[i][p], xb, wv[p]);
  }
}

// Both instantiations carry the bf16 target attribute (a superset of the fp32 tile's);
// only the bf16 tile contains an AVX512_BF16 instruction, and linear_has_avx512 gates it.
template <class S, int MR, int T>
DSPEC_AVX512BF16 void micro_avx512(const Tile& t) {
  using E = typename S::E;
  const E* x = static_cast<const E*>(t.x);
  const E* w = static_cast<const E*>(t.w);
  __m512 acc[MR][T];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int p = 0; p < T; ++p) acc[i][p] = _mm512_setzero_ps();
  const std::int64_t full = t.k / S::kS;
  const std::int64_t ahead = std::int64_t(t.prefetch_steps) * T * kPanel * S::kS;
  const E* end = static_cast<const E*>(t.stream_end);
  for (std::int64_t s = 0; s < full; ++s) micro_step<S, MR, T, false>(acc, x, t.ldx, w, s, ahead, end);
  if (full * S::kS < t.k) micro_step<S, MR, T, true>(acc, x, t.ldx, w, full, ahead, end);
  const __mmask16 last = static_cast<__mmask16>((1u << t.last_cols) - 1);
  E* out = static_cast<E*>(t.out);
#pragma GCC unroll 4
  for (int p = 0; p < T; ++p) {
    const __m512 b = _mm512_loadu_ps(t.bias + p * kPanel);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      S::store(out + i * t.ldo + p * kPanel, _mm512_add_ps(acc[i][p], b), p == T - 1 ? last : __mmask16(0xffff));
    }
  }
}
#endif

// ---------------------------------------------------------------------- AVX2 code

#if DSPEC_LINEAR_X86
#define DSPEC_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define DSPEC_AVX2_INLINE DSPEC_AVX2 inline __attribute__((always_inline))

// AVX2 + FMA tiles.  A 16-column panel is two 8-lane halves, and one k step of a group is
// one 64-byte line per panel (T lines in a row).  With 16 vector registers a pass holds
// MR rows x T panels x NH halves of float32 accumulators (<= 12): 1 row takes both halves,
// 2-3 rows one half a pass (two passes), so every pass reads every line of the group's
// stream in order -- the hardware prefetchers follow one sequential stream (passes over
// every T-th line measured 2-3x slower from memory).  A call runs k in chunks
// (kAvx2ChunkSteps), each chunk through all passes and row blocks while it sits in cache.
// The 16-bit dtypes widen their weights in registers (bfloat16 by a shift or a mask,
// float16 by F16C) and every element is one FMA in k order, acc = fma(x[k], w[k], acc),
// so the bits never depend on the rows of the call, the passes, the chunks or the threads,
// and float32 gives the AVX-512 tiles' bits.

// Half h (columns 8h .. 8h+7) of a 16-bit panel step as 8 element pairs.  ws: the step's
// 16 x 2 elements.
template <int DT>
DSPEC_AVX2_INLINE __m256i avx2_load_half(const dt::elem_t<DT>* ws, int h) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + 16 * h));
}

// Element e of the 8 pairs of a 16-bit half loaded by avx2_load_half (32-bit lane c holds
// column c's pair: k even in the low half, k odd in the high half), as float32.
template <int DT, int e>
DSPEC_AVX2_INLINE __m256 avx2_widen_pairs(__m256i v) {
  if constexpr (DT == kBFloat16) {
    if constexpr (e == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  } else {
    const __m256i a = e == 0 ? _mm256_and_si256(v, _mm256_set1_epi32(0xffff)) : _mm256_srli_epi32(v, 16);
    // the 8 halves in column order, then F16C's exact widening
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, a), 0x88);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
  }
}

// Columns 8h .. 8h+7 of k element e (0 or 1) of a panel step, as float32.  ws: the step's
// 16 x S elements.
template <int DT, int e>
DSPEC_AVX2_INLINE __m256 avx2_widen(const dt::elem_t<DT>* ws, int h) {
  if constexpr (DT == kFloat32) {
    return _mm256_loadu_ps(ws + 8 * h);
  } else {
    return avx2_widen_pairs<DT, e>(avx2_load_half<DT>(ws, h));
  }
}

// x[k] of one row as 8 float32 lanes, x pointing at the step's first element and k the
// step's element e.  Paired: x[k - e + 1] exists (not the first element of an odd k's last
// pair), so bfloat16 loads the pair with one 32-bit broadcast and keeps its half.
template <int DT, int e, bool kPaired>
DSPEC_AVX2_INLINE __m256 avx2_broadcast(const dt::elem_t<DT>* x) {
  if constexpr (DT == kFloat32) {
    return _mm256_broadcast_ss(x);
  } else if constexpr (DT == kBFloat16 && kPaired) {
    std::int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    const __m256i b = _mm256_set1_epi32(pair);
    if constexpr (e == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  } else if constexpr (DT == kBFloat16) {
    return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<std::int32_t>(static_cast<std::uint32_t>(x[e]) << 16)));
  } else {
    return _mm256_set1_ps(_cvtsh_ss(x[e]));
  }
}

// dt::float_to_bf16 on 8 lanes, as 8 16-bit results
DSPEC_AVX2_INLINE __m128i avx2_round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))),
                        16);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// the first `cols` (1..8) of 8 float32 lanes, rounded to the dtype
template <int DT>
DSPEC_AVX2_INLINE void avx2_store(dt::elem_t<DT>* out, __m256 v, int cols) {
  if constexpr (DT == kFloat32) {
    if (cols >= 8) {
      _mm256_storeu_ps(out, v);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, v);
      std::memcpy(out, tmp, sizeof(float) * static_cast<std::size_t>(cols));
    }
  } else {
    const __m128i h =
        DT == kBFloat16 ? avx2_round_bf16(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (cols >= 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
    } else {
      alignas(16) std::uint16_t tmp[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
      std::memcpy(out, tmp, sizeof(std::uint16_t) * static_cast<std::size_t>(cols));
    }
  }
}

// acc += x[k] * w[k] for the E elements (k order) of one step: ws the step's first panel,
// rows[i] + at row i's first element of the step, halves [H0, H0 + NH) of every panel.  Each
// weight vector is loaded once and feeds every row before the next one loads, so a pass
// holds its MR x E broadcasts, MR x T x NH accumulators and one or two weight vectors in
// the 16 registers (the passes are sized for it, avx2_rows): a spilled accumulator turns
// its FMA chain into a store-to-load chain through the stack.  Per accumulator the FMAs
// still run in k order.
template <int DT, int MR, int T, int H0, int NH, int E, bool kPaired = true>
DSPEC_AVX2_INLINE void avx2_step(__m256 (&acc)[MR][T][NH], const dt::elem_t<DT>* ws,
                                 const dt::elem_t<DT>* const (&rows)[MR], std::int64_t at) {
  constexpr int S = step_of(DT);
  __m256 xb[E][MR];
#pragma GCC unroll 3
  for (int i = 0; i < MR; ++i) {
    xb[0][i] = avx2_broadcast<DT, 0, kPaired>(rows[i] + at);
    if constexpr (E == 2) xb[E - 1][i] = avx2_broadcast<DT, E - 1, kPaired>(rows[i] + at);
  }
#pragma GCC unroll 4
  for (int p = 0; p < T; ++p) {
#pragma GCC unroll 2
    for (int h = 0; h < NH; ++h) {
      if constexpr (DT == kFloat32) {
        const __m256 w = _mm256_loadu_ps(ws + p * kPanel + 8 * (H0 + h));
#pragma GCC unroll 3
        for (int i = 0; i < MR; ++i) acc[i][p][h] = _mm256_fmadd_ps(xb[0][i], w, acc[i][p][h]);
      } else {
        const __m256i v = avx2_load_half<DT>(ws + p * kPanel * S, H0 + h);
        const __m256 w0 = avx2_widen_pairs<DT, 0>(v);
#pragma GCC unroll 3
        for (int i = 0; i < MR; ++i) acc[i][p][h] = _mm256_fmadd_ps(xb[0][i], w0, acc[i][p][h]);
        if constexpr (E == 2) {
          const __m256 w1 = avx2_widen_pairs<DT, 1>(v);
#pragma GCC unroll 3
          for (int i = 0; i < MR; ++i) acc[i][p][h] = _mm256_fmadd_ps(xb[E - 1][i], w1, acc[i][p][h]);
        }
      }
    }
  }
}

// One pass: MR rows x halves [H0, H0 + NH) of the group's T panels over the tile's k steps.
template <int DT, int MR, int T, int H0, int NH>
DSPEC_AVX2_INLINE void avx2_pass(const Tile& t, int r0, bool fetch) {
  using E = dt::elem_t<DT>;
  constexpr int S = step_of(DT);
  constexpr std::int64_t kAccStride = kPanel * kPanelBlock;
  const E* w = static_cast<const E*>(t.w);
  float* carried = t.acc + r0 * kAccStride;
  __m256 acc[MR][T][NH];
#pragma GCC unroll 3
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int p = 0; p < T; ++p)
#pragma GCC unroll 2
      for (int h = 0; h < NH; ++h) {
        const float* c = carried + i * kAccStride + p * kPanel + 8 * (H0 + h);
        acc[i][p][h] = t.first ? _mm256_setzero_ps() : _mm256_loadu_ps(c);
      }
  const E* rows[MR];
#pragma GCC unroll 3
  for (int i = 0; i < MR; ++i) rows[i] = static_cast<const E*>(t.x) + (r0 + i) * t.ldx;
  // the pair (k - 1, k) of an odd k exists only in its first element
  const std::int64_t whole = S == 2 && t.s1 * 2 > t.k ? t.s1 - 1 : t.s1;
#pragma GCC unroll 2
  for (std::int64_t s = t.s0; s < whole; ++s) {
    const E* ws = w + s * T * kPanel * S;
    if (fetch) {
      const char* line = t.pf + (s - t.s0) * t.pf_lines * 64;
      for (int j = 0; j < t.pf_lines; ++j) {
        if (line + 64 * j < t.pf_end) _mm_prefetch(line + 64 * j, _MM_HINT_T0);
      }
    }
    avx2_step<DT, MR, T, H0, NH, S>(acc, ws, rows, s * S);
  }
  if (whole < t.s1) avx2_step<DT, MR, T, H0, NH, 1, false>(acc, w + whole * T * kPanel * S, rows, whole * S);
  if (!t.last) {
#pragma GCC unroll 3
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int p = 0; p < T; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < NH; ++h) {
          _mm256_storeu_ps(carried + i * kAccStride + p * kPanel + 8 * (H0 + h), acc[i][p][h]);
        }
    return;
  }
#pragma GCC unroll 4
  for (int p = 0; p < T; ++p) {
    const int cols = p == T - 1 ? t.last_cols : kPanel;
#pragma GCC unroll 2
    for (int h = 0; h < NH; ++h) {
      const int c0 = 8 * (H0 + h);
      if (c0 >= cols) continue;
      const __m256 b = _mm256_loadu_ps(t.bias + p * kPanel + c0);
#pragma GCC unroll 3
      for (int i = 0; i < MR; ++i) {
        E* o = static_cast<E*>(t.out) + (r0 + i) * t.ldo + p * kPanel + c0;
        avx2_store<DT>(o, _mm256_add_ps(acc[i][p][h], b), cols - c0 < 8 ? cols - c0 : 8);
      }
    }
  }
}

// One float32 pass of MR (4 .. 6) rows over panel P of the group's T panels, both halves
// (2 x MR accumulators, one row's broadcast at a time): each k step reads the panel's one
// 64-byte line, whole, where the half passes of avx2_rows read half of every panel's line.
// A chunk's lines come from cache (an earlier pass read them in order), so the stride of
// T lines between steps costs nothing; the FMAs still run in k order per accumulator.
template <int MR, int T, int P>
DSPEC_AVX2_INLINE void avx2_panel_pass(const Tile& t) {
  constexpr std::int64_t kAccStride = kPanel * kPanelBlock;
  const float* w = static_cast<const float*>(t.w) + P * kPanel;
  float* carried = t.acc + P * kPanel;
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
      acc[i][h] = t.first ? _mm256_setzero_ps() : _mm256_loadu_ps(carried + i * kAccStride + 8 * h);
  const float* rows[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) rows[i] = static_cast<const float*>(t.x) + i * t.ldx;
#pragma GCC unroll 2
  for (std::int64_t s = t.s0; s < t.s1; ++s) {
    const float* ws = w + s * T * kPanel;
    const __m256 w0 = _mm256_loadu_ps(ws), w1 = _mm256_loadu_ps(ws + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 b = _mm256_broadcast_ss(rows[i] + s);
      acc[i][0] = _mm256_fmadd_ps(b, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(b, w1, acc[i][1]);
    }
  }
  if (!t.last) {
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(carried + i * kAccStride + 8 * h, acc[i][h]);
    return;
  }
  const int cols = P == T - 1 ? t.last_cols : kPanel;
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const int c0 = 8 * h;
    if (c0 >= cols) continue;
    const __m256 b = _mm256_loadu_ps(t.bias + P * kPanel + c0);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      avx2_store<kFloat32>(static_cast<float*>(t.out) + i * t.ldo + P * kPanel + c0, _mm256_add_ps(acc[i][h], b),
                           cols - c0 < 8 ? cols - c0 : 8);
    }
  }
}

template <int MR, int T, int P>
DSPEC_AVX2_INLINE void avx2_panel_passes(const Tile& t) {
  if constexpr (P < T) {
    avx2_panel_pass<MR, T, P>(t);
    avx2_panel_passes<MR, T, P + 1>(t);
  }
}

// Rows [R0, MR) of the tile in passes that fit the 16 registers (avx2_step): float32 tiles
// of up to 3 rows in one block (12 accumulators, 3 broadcasts, one weight vector), the
// 16-bit dtypes in blocks of 2 (8 accumulators, 2 x 2 broadcasts of an element pair, the
// loaded pair vector and its widened element).  Float32 tiles of 4 .. 6 rows run one
// whole-line pass per panel instead (avx2_panel_pass; the callers give them chunks already
// in cache).
template <int DT, int MR, int T, int R0>
DSPEC_AVX2_INLINE void avx2_rows(const Tile& t) {
  if constexpr (DT == kFloat32 && R0 == 0 && MR >= 4) {
    avx2_panel_passes<MR, T, 0>(t);
  } else if constexpr (R0 < MR) {
    constexpr int kLeft = MR - R0;
    constexpr int R = DT != kFloat32 ? (kLeft < 2 ? kLeft : 2) : (kLeft < 3 ? kLeft : 3);
    if constexpr (R == 1) {
      // one row: its only pass fetches the next chunk (bf16 LM head, one row, in-process A/B:
      // 0.97x the time at one thread, 0.99-1.04x at two, where the stream is at its floor)
      avx2_pass<DT, 1, T, 0, 2>(t, R0, R0 == 0 && t.pf != nullptr);
    } else {
      avx2_pass<DT, R, T, 0, 1>(t, R0, false);
      // the first compute-only pass (its lines came in with the first) fetches the next chunk
      avx2_pass<DT, R, T, 1, 1>(t, R0, R0 == 0 && t.pf != nullptr);
    }
    avx2_rows<DT, MR, T, R0 + R>(t);
  }
}

template <int DT, int MR, int T>
DSPEC_AVX2 void micro_avx2(const Tile& t) {
  avx2_rows<DT, MR, T, 0>(t);
}

// The 16-bit dtypes from kAvx2WidenRows rows: each k chunk of a group is widened once
// into a float32 buffer in the float32 panel layout (group steps [p0, p1) -> k elements
// [2 p0, min(2 p1, k)), tp panels), and x once into float32 rows, so that the float32 tiles
// run every pass and row block from them: the widening (shifts on the FMA pipes) is paid
// once per chunk instead of once per pass.  The FMA chain per output is the same --
// x[k] * w[k] in k order -- so the bits are those of the 16-bit tiles.
template <int DT>
DSPEC_AVX2 void avx2_widen_chunk(const dt::elem_t<DT>* wg, int tp, std::int64_t p0, std::int64_t p1, std::int64_t k,
                                 float* buf) {
  for (std::int64_t s = p0; s < p1; ++s) {
    for (int p = 0; p < tp; ++p) {
      const dt::elem_t<DT>* ws = wg + (s * tp + p) * kPanel * 2;
      float* even = buf + ((2 * (s - p0)) * tp + p) * kPanel;
      _mm256_storeu_ps(even, avx2_widen<DT, 0>(ws, 0));
      _mm256_storeu_ps(even + 8, avx2_widen<DT, 0>(ws, 1));
      if (2 * s + 1 < k) {
        float* odd = even + tp * kPanel;
        _mm256_storeu_ps(odd, avx2_widen<DT, 1>(ws, 0));
        _mm256_storeu_ps(odd + 8, avx2_widen<DT, 1>(ws, 1));
      }
    }
  }
}

// out[i][c] = round(acc[i][c] + bias[c]) for rows [0, m), columns [0, cols).
template <int DT>
DSPEC_AVX2 void avx2_finish(const float* acc, std::int64_t m, int cols, const float* bias, dt::elem_t<DT>* out,
                            std::int64_t ldo) {
  for (std::int64_t i = 0; i < m; ++i) {
    for (int c = 0; c < cols; c += 8) {
      const __m256 v = _mm256_add_ps(_mm256_loadu_ps(acc + i * kPanel * kPanelBlock + c), _mm256_loadu_ps(bias + c));
      avx2_store<DT>(out + i * ldo + c, v, cols - c < 8 ? cols - c : 8);
    }
  }
}
#endif

// ---------------------------------------------------------------------- AMX code

#if DSPEC_AMX_CODE
#define DSPEC_AMX DSPEC_AMX_TARGET
constexpr int kAmxRows = cpu::kAmxMaxRows;

// Tiles 0-3 accumulate the tile's rows x 16 columns of one panel each in float32, tile 4
// holds rows x 32 k of x, tiles 5-7 rotate the panels' B operands (16 k pairs x 16 columns).
DSPEC_AMX inline void amx_configure(int rows) { cpu::amx_configure(rows, 5); }

// One step of 32 k for panel P of the group: B tile BT from the packed stream (row stride:
// the group's T panels), accumulated into tile P.  (The tile intrinsics take literal tile
// numbers.)
#define DSPEC_AMX_PANEL(P, BT)                           \
  do {                                                   \
    _tile_loadd(BT, block + (P) * kPanel * 2, b_stride); \
    _tile_dpbf16ps(P, 4, BT);                            \
  } while (0)

// What a tile prefetches while it runs: at its k block d, the lines [from + d * per_block,
// + per_block) below end, into L1 (the stream just ahead) or L2 (the next group, fetched
// while a later row block of the same group computes from cache).
struct AmxPrefetch {
  const char* from = nullptr;
  std::int64_t per_block = 0;
  const char* end = nullptr;
  bool to_l2 = false;
};

// rows (the configured tile rows) x the group's T panels over kp (a multiple of 32) into acc,
// float32 [rows][T * 16] at a row stride of 64 floats.
template <int T>
DSPEC_AMX void micro_amx(const std::uint16_t* x, std::int64_t ldx, const std::uint16_t* w, std::int64_t kp,
                         const AmxPrefetch& pf, float* acc) {
  _tile_zero(0);
  if constexpr (T > 1) _tile_zero(1);
  if constexpr (T > 2) _tile_zero(2);
  if constexpr (T > 3) _tile_zero(3);
  constexpr std::int64_t block_elems = std::int64_t(kTileDepth / 2) * T * kPanel * 2;  // 16 steps
  const long x_stride = long(ldx) * 2;
  constexpr long b_stride = long(T) * kPanel * 2 * 2;
  for (std::int64_t d = 0; d < kp / kTileDepth; ++d) {
    const std::uint16_t* block = w + d * block_elems;
    const char* ahead = pf.from + d * pf.per_block;
    if (pf.per_block > 0 && ahead < pf.end) {
      const char* stop = std::min(ahead + pf.per_block, pf.end);
      if (pf.to_l2) {
        for (const char* p = ahead; p < stop; p += 64) _mm_prefetch(p, _MM_HINT_T1);
      } else {
        for (const char* p = ahead; p < stop; p += 64) _mm_prefetch(p, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, x + d * kTileDepth, x_stride);
    DSPEC_AMX_PANEL(0, 5);
    if constexpr (T > 1) DSPEC_AMX_PANEL(1, 6);
    if constexpr (T > 2) DSPEC_AMX_PANEL(2, 7);
    if constexpr (T > 3) DSPEC_AMX_PANEL(3, 5);
  }
  constexpr long acc_stride = kPanel * kPanelBlock * 4;
  _tile_stored(0, acc, acc_stride);
  if constexpr (T > 1) _tile_stored(1, acc + kPanel, acc_stride);
  if constexpr (T > 2) _tile_stored(2, acc + 2 * kPanel, acc_stride);
  if constexpr (T > 3) _tile_stored(3, acc + 3 * kPanel, acc_stride);
}

// Two row blocks x two panels (H, H + 1) of a full group (T = 4): tiles 0-3 accumulate (rows
// 0-15, H), (0-15, H + 1), (16-31, H), (16-31, H + 1), tiles 4 / 5 hold the two row blocks'
// x, 6 / 7 the panels' B operands: one B tile load per two tile products instead of one
// per product when many row blocks re-read a group (a prefill).  Every accumulator sums
// its k blocks in micro_amx's order, so the bits are micro_amx's.  acc: float32 [32][32].
template <int H>
DSPEC_AMX void micro_amx_pair(const std::uint16_t* x, std::int64_t ldx, const std::uint16_t* w, std::int64_t kp,
                              const AmxPrefetch& pf, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr std::int64_t block_elems = std::int64_t(kTileDepth / 2) * kPanelBlock * kPanel * 2;
  const long x_stride = long(ldx) * 2;
  constexpr long b_stride = long(kPanelBlock) * kPanel * 2 * 2;
  const std::uint16_t* x1 = x + kAmxRows * ldx;
  for (std::int64_t d = 0; d < kp / kTileDepth; ++d) {
    const std::uint16_t* block = w + d * block_elems;
    const char* ahead = pf.from + d * pf.per_block;
    if (pf.per_block > 0 && ahead < pf.end) {
      const char* stop = std::min(ahead + pf.per_block, pf.end);
      for (const char* p = ahead; p < stop; p += 64) _mm_prefetch(p, _MM_HINT_T0);
    }
    _tile_loadd(4, x + d * kTileDepth, x_stride);
    _tile_loadd(5, x1 + d * kTileDepth, x_stride);
    _tile_loadd(6, block + H * kPanel * 2, b_stride);
    _tile_loadd(7, block + (H + 1) * kPanel * 2, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  constexpr long acc_stride = 2 * kPanel * 4;
  _tile_stored(0, acc, acc_stride);
  _tile_stored(1, acc + kPanel, acc_stride);
  _tile_stored(2, acc + kAmxRows * 2 * kPanel, acc_stride);
  _tile_stored(3, acc + kAmxRows * 2 * kPanel + kPanel, acc_stride);
}

// From this many rows a full group's row blocks go in pairs (micro_amx_pair).  Forwards of
// 16-64 rows measured 0.94-0.97x with pairs: their first row block streams the
// weights from memory either way.
constexpr std::int64_t kPairMinRows = 128;
constexpr std::int64_t kPairChunkRows = 256;

using AmxMicro = void (*)(const std::uint16_t*, std::int64_t, const std::uint16_t*, std::int64_t, const AmxPrefetch&,
                          float*);
constexpr AmxMicro kAmxMicro[kPanelBlock] = {&micro_amx<1>, &micro_amx<2>, &micro_amx<3>, &micro_amx<4>};

// Columns [c0, c0 + cols) of the bias as float32 (zeros without a bias).
DSPEC_AMX inline void group_bias(const LinearArgs& a, std::int64_t c0, int cols, float* bias) {
  for (int c = 0; c < cols; ++c) bias[c] = a.bias != nullptr ? dt::load<kBFloat16>(a.bias, c0 + c) : 0.0f;
}

// rows x cols float32 accumulators (acc_stride floats apart) plus bias, rounded to bf16 rows
// of out (ldo elements apart).
DSPEC_AMX inline void store_rows_bf16(const float* acc, std::int64_t acc_stride, const float* bias, int rows, int cols,
                                      std::uint16_t* out, std::int64_t ldo) {
  for (int i = 0; i < rows; ++i) {
    for (int c = 0; c < cols; c += kPanel) {
      const __mmask16 m = cpu::lanes(cols - c);
      const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + i * acc_stride + c), _mm512_maskz_loadu_ps(m, bias + c));
      _mm256_mask_storeu_epi16(out + i * ldo + c, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// Panels [p0, p1) of one bf16 projection on the tile unit, every row of x: row blocks of 16
// inside each panel group, so a group's weight (k * 128 bytes) is read from memory once and
// from L2 for the next blocks.  x is read in place when its rows fill whole tiles; a last
// partial block of a call of more than 16 rows, and every row when k is not a multiple of 32,
// go through a zero-padded copy (zeros add nothing to a sum).
DSPEC_AMX void panels_amx(const LinearArgs& a, std::int64_t p0, std::int64_t p1) {
  using E = std::uint16_t;
  const std::int64_t kp = padded_k(a.k, kBFloat16);
  const std::int64_t panel = linear_panel_elements(a.k, kBFloat16);
  const E* x = static_cast<const E*>(a.x);
  const E* w = static_cast<const E*>(a.weight);
  E* out = static_cast<E*>(a.out);
  const int tile_rows = static_cast<int>(std::min<std::int64_t>(a.m, kAmxRows));
  const bool pad_k = kp != a.k;
  const std::int64_t full_rows = a.m <= kAmxRows ? a.m : a.m / kAmxRows * kAmxRows;
  // the rows that go through the copy: all of them when k is padded, else the partial block
  const std::int64_t copy_from = pad_k ? 0 : full_rows;
  thread_local std::vector<E> padded;
  if (copy_from < a.m) {
    const std::int64_t rows = (a.m - copy_from + kAmxRows - 1) / kAmxRows * kAmxRows;
    padded.assign(static_cast<std::size_t>(rows * kp), E(0));
    for (std::int64_t i = copy_from; i < a.m; ++i)
      std::memcpy(padded.data() + (i - copy_from) * kp, x + i * a.ldx, static_cast<std::size_t>(a.k) * sizeof(E));
    std::atomic_signal_fence(std::memory_order_seq_cst);  // tile loads are asm the compiler cannot see through
  }
  alignas(64) float acc[kAmxRows][kPanel * kPanelBlock];
  const std::int64_t prefetch_bytes =
      std::int64_t(g_prefetch_steps.load(std::memory_order_relaxed)) * kPanelBlock * kPanel * 2 * sizeof(E);
  const char* stream_end = reinterpret_cast<const char*>(w + p1 * panel);
  amx_configure(tile_rows);
  // Long inputs (prefills): row-block pairs over full groups, in chunks of kPairChunkRows
  // rows with the thread's groups inside, so that a chunk's x and the thread's weights stay
  // in L2 (groups outside re-read all of x from L3 for every group).  Rows past the pairs
  // and groups with fewer than 64 columns take the loop below.
  const std::int64_t paired_rows =
      a.m >= kPairMinRows ? std::min(copy_from, full_rows) / (2 * kAmxRows) * (2 * kAmxRows) : 0;
  for (std::int64_t mb = 0; mb < paired_rows; mb += kPairChunkRows) {
    const std::int64_t me = std::min(paired_rows, mb + kPairChunkRows);
    for (std::int64_t g = p0; g + kPanelBlock <= p1; g += kPanelBlock) {
      const std::int64_t c0 = g * kPanel;
      if (a.n - c0 < kPanel * kPanelBlock) continue;
      float bias[kPanel * kPanelBlock];
      group_bias(a, c0, kPanel * kPanelBlock, bias);
      const E* wg = w + g * panel;
      const std::int64_t group_bytes = kPanelBlock * panel * std::int64_t(sizeof(E));
      for (std::int64_t i0 = mb; i0 < me; i0 += 2 * kAmxRows) {
        alignas(64) float acc2[2 * kAmxRows][2 * kPanel];
        for (int h = 0; h < kPanelBlock; h += 2) {
          AmxPrefetch pf;
          if (i0 == 0 && h == 0) {  // the first pass streams the whole group: prefetch it all
            pf = {reinterpret_cast<const char*>(wg) + prefetch_bytes,
                  prefetch_bytes > 0 ? group_bytes / (kp / kTileDepth) : 0, stream_end, false};
          }
          (h == 0 ? micro_amx_pair<0> : micro_amx_pair<2>)(x + i0 * a.ldx, a.ldx, wg, kp, pf, &acc2[0][0]);
          store_rows_bf16(&acc2[0][0], 2 * kPanel, bias + h * kPanel, 2 * kAmxRows, 2 * kPanel,
                          out + i0 * a.ldo + c0 + h * kPanel, a.ldo);
        }
      }
    }
  }
  for (std::int64_t g = p0; g < p1; g += kPanelBlock) {
    const int tp = static_cast<int>(std::min<std::int64_t>(kPanelBlock, p1 - g));
    const std::int64_t c0 = g * kPanel;
    const int cols = static_cast<int>(std::min<std::int64_t>(kPanel * tp, a.n - c0));
    float bias[kPanel * kPanelBlock];
    group_bias(a, c0, cols, bias);
    const E* wg = w + g * panel;
    const std::int64_t group_bytes = tp * panel * std::int64_t(sizeof(E));
    const std::int64_t blocks = kp / kTileDepth;
    const std::int64_t paired = cols == kPanel * kPanelBlock ? paired_rows : 0;  // done above
    for (std::int64_t i0 = paired, r = paired / kAmxRows; i0 < a.m; i0 += kAmxRows, ++r) {
      const int mr = static_cast<int>(std::min<std::int64_t>(tile_rows, a.m - i0));
      const bool copied = i0 >= copy_from;
      const E* xs = copied ? padded.data() + (i0 - copy_from) * kp : x + i0 * a.ldx;
      // the first row block streams the group from memory (prefetching just ahead); the others
      // read it from cache and meanwhile bring the next group into L2, a share each
      AmxPrefetch pf;
      if (r == 0) {
        pf = {reinterpret_cast<const char*>(wg) + prefetch_bytes, prefetch_bytes > 0 ? group_bytes / blocks : 0,
              stream_end, false};
      } else {
        const std::int64_t later = (a.m + kAmxRows - 1) / kAmxRows - 1;
        const std::int64_t share = (kPanelBlock * panel * std::int64_t(sizeof(E)) + later - 1) / later;
        const char* next = reinterpret_cast<const char*>(wg) + group_bytes + (r - 1) * share;
        pf = {next, (share + blocks - 1) / blocks, std::min(next + share, stream_end), true};
      }
      kAmxMicro[tp - 1](xs, copied ? kp : a.ldx, wg, kp, pf, &acc[0][0]);
      store_rows_bf16(&acc[0][0], kPanel * kPanelBlock, bias, mr, cols, out + i0 * a.ldo + c0, a.ldo);
    }
  }
  _tile_release();
}
#endif

// ---------------------------------------------------------------------- dispatch tables

template <template <int, int> class Pick, int MR, int... Ts>
void fill_row(Micro (&row)[kPanelBlock], std::integer_sequence<int, Ts...>) {
  ((row[Ts] = Pick<MR, Ts + 1>::fn), ...);
}

template <template <int, int> class Pick, int... MRs>
void fill(Micro (&table)[kRowBlock][kPanelBlock], std::integer_sequence<int, MRs...>) {
  (fill_row<Pick, MRs + 1>(table[MRs], std::make_integer_sequence<int, kPanelBlock>{}), ...);
}

template <int DT>
struct PickGeneric {
  template <int MR, int T>
  struct At {
    static constexpr Micro fn = &micro_generic<DT, MR, T>;
  };
};

struct Table {
  Micro fn[kRowBlock][kPanelBlock];
};

template <class Picker>
Table make_table() {
  Table t{};
  fill<Picker::template At>(t.fn, std::make_integer_sequence<int, kRowBlock>{});
  return t;
}

#if DSPEC_LINEAR_X86
template <class S>
struct PickAvx512 {
  template <int MR, int T>
  struct At {
    static constexpr Micro fn = &micro_avx512<S, MR, T>;
  };
};

template <int DT>
struct PickAvx2 {
  template <int MR, int T>
  struct At {
    static constexpr Micro fn = &micro_avx2<DT, MR, T>;
  };
};
#endif

// The tiles of one dtype at one level (kLinearGeneric / kLinearAvx2 / kLinearAvx512).
const Table& table_for(int dtype, int isa) {
  static const Table generic_f32 = make_table<PickGeneric<kFloat32>>();
  static const Table generic_f16 = make_table<PickGeneric<kFloat16>>();
  static const Table generic_bf16 = make_table<PickGeneric<kBFloat16>>();
#if DSPEC_LINEAR_X86
  static const Table avx_f32 = make_table<PickAvx512<F32Step>>();
  static const Table avx_bf16 = make_table<PickAvx512<Bf16Step>>();
  static const Table avx2_f32 = make_table<PickAvx2<kFloat32>>();
  static const Table avx2_f16 = make_table<PickAvx2<kFloat16>>();
  static const Table avx2_bf16 = make_table<PickAvx2<kBFloat16>>();
  if (isa == kLinearAvx512 && dtype == kFloat32) return avx_f32;
  if (isa == kLinearAvx512 && dtype == kBFloat16) return avx_bf16;
  if (isa == kLinearAvx2) return dtype == kFloat32 ? avx2_f32 : (dtype == kFloat16 ? avx2_f16 : avx2_bf16);
#endif
  (void)isa;
  return dtype == kFloat32 ? generic_f32 : (dtype == kFloat16 ? generic_f16 : generic_bf16);
}

// The vector tiles a call runs (kLinearGeneric / kLinearAvx2 / kLinearAvx512; AMX is
// decided beside): `isa` asked, capped by what the CPU and $DSPEC_CPU_ISA allow.
int vector_isa(int dtype, int isa) {
  if (isa == kLinearGeneric) return kLinearGeneric;
  if (isa != kLinearAvx2 && linear_has_avx512(dtype)) return kLinearAvx512;
  return linear_has_avx2(dtype) ? kLinearAvx2 : kLinearGeneric;
}

// The AVX2 tiles' chunk of k steps and row block.  128 steps are 32 KB of a 4-panel group
// (k pairs for the 16-bit dtypes), about L1, while every pass and row block of the call reads
// it; rows go in blocks of 3 (a 3-row pass holds 12 accumulators, a 2-row pass 8, too few to
// cover the FMA latency).  SmolLM2-135M's fp32 projections, all 30 layers from memory, one
// thread, AVX2 on an EPYC (Zen 4) under DSPEC_CPU_ISA=avx2, 6 / 16 rows: 38.4 / 50.5 ms at
// 64 steps, 28.3 / 48.1 at 96, 27.5 / 49.2 at 128, 29.3 / 58.0 at 192; blocks of 6 rows
// 35.2 / 58.8 ms at 64 steps.  A software prefetch of the next chunk by the first pass
// measured slower (46.7 / 73.9 ms at 128 steps): the hardware prefetchers follow the passes'
// sequential line stream better.  From memory a call costs about its streaming time plus its
// compute time: only the first pass of a chunk reads DRAM (60 up-projections 576 -> 1536 of
// float32, one thread, Zen 4 capped: 1 row 10.3 ms, 16 rows 32.6-38.5 ms, the same 16 rows
// 20.6 ms with the weights in L3).  Prefetching the next chunk from every row block's pass
// (one line a k step, _MM_HINT_T0 / T1 / T2, or scalar loads that train the hardware
// prefetchers; chunks of 32-128 steps) measured slower in every variant (1 row 12.2-17.1 ms,
// 9 rows 27.9-42.6 ms against 17.8-24.2, 16 rows 34.1-55.7 ms): on this core every hint fills
// L1, where the passes need the whole chunk.
constexpr std::int64_t kAvx2ChunkSteps = 128;
// The AVX2 tiles' k chunk in steps, per weight width: [0] float32, kAvx2ChunkSteps
// (above), [1] the 16-bit dtypes' unwidened passes, 16 steps (4 KB of a 4-panel group): from 2
// rows a chunk's later passes re-read its weight lines from L1, and at 128 steps (32 KB, with
// the next chunk prefetched beside it) those re-reads miss.  bench/results/cpu/avx2/
// forward_zen3_avx2_chunks.json times both on whole forwards (bench_forward.py
// --avx2-chunk-steps); float32 gains nothing from a shorter chunk.  linear_avx2_chunk_steps
// sets either.
std::atomic<int> g_avx2_chunk_steps[2] = {static_cast<int>(kAvx2ChunkSteps), 16};
// From this many rows the 16-bit dtypes run the float32 tiles on widened chunks
// (widened_panels): with the 16-step chunks above the unwidened passes stay faster up to
// 12 rows and the two meet at about 16 (SmolLM2-135M bf16 forwards, both thresholds
// interleaved in one process on AVX2 Zen 3, 1 and 2 threads).
constexpr std::int64_t kAvx2WidenRows = 13;
constexpr std::int64_t kAvx2RowBlock = 3;
// The rows of the AVX2 row block at row i0 of a chunk: float32 blocks after the first run
// 6 rows by whole panel lines (avx2_panel_pass) from the cache the first block's half
// passes read the chunk into in line order.
constexpr std::int64_t kAvx2PanelRowBlock = 6;
constexpr std::int64_t avx2_row_block(int dtype, std::int64_t i0) {
  return dtype == kFloat32 && i0 > 0 ? kAvx2PanelRowBlock : kAvx2RowBlock;
}

#if DSPEC_LINEAR_X86
// One group of a 16-bit projection through the float32 AVX2 tiles on widened chunks
// (avx2_widen_chunk); t: the group's tile (w, bias, last_cols), x: the call's rows.
// x [m, k] of dtype DT as float32 rows [m, k] (xf).
template <int DT>
void widen_rows(const LinearArgs& a, std::vector<float>& xf) {
  xf.resize(static_cast<std::size_t>(a.m * a.k));
  for (std::int64_t i = 0; i < a.m; ++i) {
    const dt::elem_t<DT>* row = static_cast<const dt::elem_t<DT>*>(a.x) + i * a.ldx;
    for (std::int64_t kk = 0; kk < a.k; ++kk) xf[i * a.k + kk] = dt::to_float<DT>(row[kk]);
  }
}

// xf: x widened (widen_rows); out: the group's first output column.
template <int DT>
void widened_panels(const LinearArgs& a, const float* xf, const Tile& t, int tp, int cols, void* out) {
  using E = dt::elem_t<DT>;
  // the float32 chunk: kAvx2ChunkSteps / 2 elements of k, 16 KB of a 4-panel group, so that it
  // shares L1 with the 16-bit lines it is widened from (a native Zen 3, one thread, in-process
  // A/B against kAvx2ChunkSteps elements: bf16 LM head 9 / 16 / 32 rows 0.89x the time, 1536 x
  // 576 up-projections 12 / 16 / 48 rows 0.83 / 0.82 / 0.86x; a quarter of it measured alike)
  constexpr std::int64_t kPairs = kAvx2ChunkSteps / 4;
  const Table& f32 = table_for(kFloat32, kLinearAvx2);
  thread_local std::vector<float> wf, partial;
  wf.resize(static_cast<std::size_t>(kAvx2ChunkSteps * kPanel * kPanelBlock));
  partial.resize(static_cast<std::size_t>(a.m * kPanel * kPanelBlock));
  const std::int64_t pairs = (a.k + 1) / 2;
  Tile f = t;
  f.ldx = a.k;
  f.w = wf.data();
  f.last = false;
  // the packed 16-bit lines of the next chunk: tp a pair step, over the chunk's 2x steps
  f.pf_end = static_cast<const char*>(t.stream_end);
  f.pf_lines = (tp + 1) / 2;
  for (std::int64_t q0 = 0; q0 < pairs; q0 += kPairs) {
    const std::int64_t q1 = std::min(pairs, q0 + kPairs);
    avx2_widen_chunk<DT>(static_cast<const E*>(t.w), tp, q0, q1, a.k, wf.data());
    f.s0 = 0;
    f.s1 = std::min(a.k, 2 * q1) - 2 * q0;
    f.first = q0 == 0;
    for (std::int64_t i0 = 0; i0 < a.m; i0 += avx2_row_block(kFloat32, i0)) {
      const int mr = static_cast<int>(std::min<std::int64_t>(avx2_row_block(kFloat32, i0), a.m - i0));
      f.x = xf + i0 * a.k + 2 * q0;
      f.acc = partial.data() + i0 * kPanel * kPanelBlock;
      // the next chunk's prefetch (bf16, 6 / 16 rows: 39.4 / 56.5 ms against 48.6 / 77.0 without it)
      const bool more = q1 < pairs && i0 == 0;
      f.pf = more ? reinterpret_cast<const char*>(static_cast<const E*>(t.w) + q1 * tp * kPanel * 2) : nullptr;
      f32.fn[mr - 1][tp - 1](f);
    }
  }
  avx2_finish<DT>(partial.data(), a.m, cols, t.bias, static_cast<E*>(out), a.ldo);
}
#endif

// Panels [p0, p1) of one projection (p0 on a group boundary), every row of x.  chunk_k (the
// AVX2 tiles): k runs in chunks of kAvx2ChunkSteps, each chunk through every pass and row
// block before the next, while the first of them prefetches the next chunk (the weights
// stream from memory once, overlapped with the compute, where whole-k row blocks stream a
// group and then compute from cache); a row's sum is still one FMA chain in k order.
template <int DT>
void panels(const LinearArgs& a, const Table& table, std::int64_t p0, std::int64_t p1, bool chunk_k = false) {
  const std::int64_t item = DT == kFloat32 ? 4 : 2;
  const std::int64_t panel = linear_panel_elements(a.k, DT);
  const char* x = static_cast<const char*>(a.x);
  const char* w = static_cast<const char*>(a.weight);
  char* out = static_cast<char*>(a.out);
  float bias[kPanel * kPanelBlock];
  const int prefetch = g_prefetch_steps.load(std::memory_order_relaxed);
  const char* stream_end = w + p1 * panel * item;
  // the 16-bit dtypes' AVX2 tiles from kAvx2WidenRows rows: float32 tiles on widened chunks
  const bool widen = DSPEC_LINEAR_X86 && DT != kFloat32 && chunk_k && a.m >= kAvx2WidenRows;
  thread_local std::vector<float> xf;
  if (widen) widen_rows<DT>(a, xf);
  for (std::int64_t g = p0; g < p1; g += kPanelBlock) {
    const int tp = static_cast<int>(std::min<std::int64_t>(kPanelBlock, p1 - g));
    const std::int64_t c0 = g * kPanel;
    const int cols = static_cast<int>(std::min<std::int64_t>(kPanel * tp, a.n - c0));
    for (int c = 0; c < kPanel * tp; ++c) bias[c] = a.bias != nullptr && c < cols ? dt::load<DT>(a.bias, c0 + c) : 0.0f;
    Tile t{nullptr, a.ldx, w + g * panel * item,     a.k,      bias,
           nullptr, a.ldo, cols - (tp - 1) * kPanel, prefetch, stream_end};
#if DSPEC_LINEAR_X86
    if constexpr (DT != kFloat32) {
      if (widen) {
        widened_panels<DT>(a, xf.data(), t, tp, cols, out + c0 * item);
        continue;
      }
    }
#endif
    if (chunk_k) {
      const std::int64_t steps = (a.k + step_of(DT) - 1) / step_of(DT);
      thread_local std::vector<float> partial;
      partial.resize(static_cast<std::size_t>(a.m * kPanel * kPanelBlock));
      t.pf_end = stream_end;
      t.pf_lines = tp;
      const std::int64_t chunk = g_avx2_chunk_steps[DT == kFloat32 ? 0 : 1].load(std::memory_order_relaxed);
      for (std::int64_t s0 = 0; s0 < steps; s0 += chunk) {
        t.s0 = s0;
        t.s1 = std::min(steps, s0 + chunk);
        t.first = s0 == 0;
        t.last = t.s1 == steps;
        for (std::int64_t i0 = 0; i0 < a.m; i0 += avx2_row_block(DT, i0)) {
          const int mr = static_cast<int>(std::min<std::int64_t>(avx2_row_block(DT, i0), a.m - i0));
          t.x = x + i0 * a.ldx * item;
          t.out = out + (i0 * a.ldo + c0) * item;
          t.acc = partial.data() + i0 * kPanel * kPanelBlock;
          // the next chunk's prefetch, 16-bit weights only (float32 measured slower with it: 6 / 16
          // rows 34.5 / 54.1 ms against 28.2 / 49.4)
          const bool more = DT != kFloat32 && t.s1 < steps && i0 == 0;
          t.pf = more ? static_cast<const char*>(t.w) + t.s1 * tp * kPanel * step_of(DT) * item : nullptr;
          table.fn[mr - 1][tp - 1](t);
        }
      }
      continue;
    }
    for (std::int64_t i0 = 0; i0 < a.m; i0 += kRowBlock) {
      const int mr = static_cast<int>(std::min<std::int64_t>(kRowBlock, a.m - i0));
      t.x = x + i0 * a.ldx * item;
      t.out = out + (i0 * a.ldo + c0) * item;
      table.fn[mr - 1][tp - 1](t);
    }
  }
}

template <int DT>
void pack_panels(const LinearPackArgs& a, std::int64_t p0, std::int64_t p1) {
  using E = dt::elem_t<DT>;
  constexpr int S = step_of(DT);
  const std::int64_t steps = padded_k(a.k, DT) / S;
  const std::int64_t count = (a.n + kPanel - 1) / kPanel;
  const E* w = static_cast<const E*>(a.weight);
  E* out = static_cast<E*>(a.packed);
  for (std::int64_t p = p0; p < p1; ++p) {
    const std::int64_t g = p / kPanelBlock, in_group = p % kPanelBlock;
    const std::int64_t tp = std::min<std::int64_t>(kPanelBlock, count - g * kPanelBlock);
    E* dst = out + g * kPanelBlock * steps * kPanel * S;
    for (std::int64_t s = 0; s < steps; ++s) {
      for (int c = 0; c < kPanel; ++c) {
        const std::int64_t row = p * kPanel + c;
        for (int e = 0; e < S; ++e) {
          const std::int64_t kk = s * S + e;
          dst[((s * tp + in_group) * kPanel + c) * S + e] = row < a.n && kk < a.k ? w[row * a.ldw + kk] : E(0);
        }
      }
    }
  }
}

}  // namespace

bool linear_has_amx(int dtype) { return DSPEC_AMX_CODE && dtype == kBFloat16 && cpu::has_amx_bf16(); }

bool linear_has_avx2(int dtype) {
  (void)dtype;
  return DSPEC_LINEAR_X86 && cpu::has_avx2();
}

bool linear_has_avx512(int dtype) {
#if DSPEC_LINEAR_X86
  if (dtype == kFloat32) return cpu::has_avx512();
  if (dtype == kBFloat16) return cpu::has_avx512_bf16();
#endif
  (void)dtype;
  return false;
}

std::int64_t linear_panel_elements(std::int64_t k, int dtype) { return padded_k(k, dtype) * kPanel; }

std::int64_t linear_packed_elements(std::int64_t n, std::int64_t k, int dtype) {
  return (n + kPanel - 1) / kPanel * linear_panel_elements(k, dtype);
}

void linear_pack_cpu(const LinearPackArgs& a) {
  const std::int64_t count = (a.n + kPanel - 1) / kPanel;
  cpu::parallel_rows(count, linear_panel_elements(a.k, a.dtype), a.num_threads, [&](std::int64_t lo, std::int64_t hi) {
    switch (a.dtype) {
      case kFloat16: pack_panels<kFloat16>(a, lo, hi); break;
      case kBFloat16: pack_panels<kBFloat16>(a, lo, hi); break;
      default: pack_panels<kFloat32>(a, lo, hi); break;
    }
  });
}

void linear_group_cpu(const LinearArgs* parts, int count) {
  const LinearArgs& a = parts[0];
  if (a.m == 0) return;
  const bool amx = (a.isa == kLinearAuto || a.isa == kLinearAmx) && linear_has_amx(a.dtype);
  const int isa = vector_isa(a.dtype, a.isa);
  const Table& table = table_for(a.dtype, isa);
  const bool chunk_k = isa == kLinearAvx2;
  // the parts' panel groups back to back: first[p] is part p's first global group
  std::vector<std::int64_t> first(static_cast<std::size_t>(count) + 1, 0);
  std::int64_t weight_elements = 0;
  for (int p = 0; p < count; ++p) {
    first[p + 1] = first[p] + (parts[p].n + kPanel * kPanelBlock - 1) / (kPanel * kPanelBlock);
    weight_elements += parts[p].n * std::max<std::int64_t>(parts[p].k, 1);
  }
  const std::int64_t groups = first[count];
  if (groups == 0) return;
  const std::int64_t by_work = weight_elements / kElementsPerThread + 1;
  const std::int64_t cap = std::min<std::int64_t>(a.num_threads, static_cast<std::int64_t>(cpu::max_threads()));
  const int threads = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>({by_work, groups, cap})));
  // Long inputs (prefills) split by rows: every thread reads all of x under a split by
  // groups, half of it from the other core's cache when the row-parallel op before wrote it
  // (a 1630-row prefill gained nothing from faster tiles that way); by rows, each thread
  // reads its own rows and all the (shared, read-only) weights.  Row ranges are whole
  // row-block pairs.  Like every split, it changes no result.
  if (threads > 1 && a.m >= kRowSplitMinRows) {
    const std::int64_t unit = 2 * 16;
    const std::int64_t units = (a.m + unit - 1) / unit;
    cpu::parallel_chunks(threads, threads, [&](int c) {
      const std::int64_t r0 = units * c / threads * unit;
      const std::int64_t r1 = std::min(a.m, units * (c + 1) / threads * unit);
      if (r0 >= r1) return;
      for (int p = 0; p < count; ++p) {
        LinearArgs part = parts[p];
        const std::int64_t item = part.dtype == kFloat32 ? 4 : 2;
        part.m = r1 - r0;
        part.x = static_cast<const char*>(part.x) + r0 * part.ldx * item;
        part.out = static_cast<char*>(part.out) + r0 * part.ldo * item;
        const std::int64_t panels_of_part = (part.n + kPanel - 1) / kPanel;
#if DSPEC_AMX_CODE
        if (amx) {
          panels_amx(part, 0, panels_of_part);
          continue;
        }
#endif
        switch (part.dtype) {
          case kFloat16: panels<kFloat16>(part, table, 0, panels_of_part, chunk_k); break;
          case kBFloat16: panels<kBFloat16>(part, table, 0, panels_of_part, chunk_k); break;
          default: panels<kFloat32>(part, table, 0, panels_of_part, chunk_k); break;
        }
      }
    });
    return;
  }
  // a few chunks of whole groups per thread, so that a thread that starts late (its core
  // busy) leaves its share to the others.  The split never changes a result: every output
  // is one tile's, in k order.
  const int chunks = static_cast<int>(std::min<std::int64_t>(groups, threads == 1 ? 1 : 4 * threads));
  auto body = [&](int c) {
    const std::int64_t g0 = groups * c / chunks, g1 = groups * (c + 1) / chunks;
    for (int p = 0; p < count; ++p) {
      const std::int64_t lo = std::max(g0, first[p]), hi = std::min(g1, first[p + 1]);
      if (lo >= hi) continue;
      const LinearArgs& part = parts[p];
      const std::int64_t panels_of_part = (part.n + kPanel - 1) / kPanel;
      const std::int64_t p0 = (lo - first[p]) * kPanelBlock;
      const std::int64_t p1 = std::min(panels_of_part, (hi - first[p]) * kPanelBlock);
#if DSPEC_AMX_CODE
      if (amx) {
        panels_amx(part, p0, p1);
        continue;
      }
#endif
      switch (part.dtype) {
        case kFloat16: panels<kFloat16>(part, table, p0, p1, chunk_k); break;
        case kBFloat16: panels<kBFloat16>(part, table, p0, p1, chunk_k); break;
        default: panels<kFloat32>(part, table, p0, p1, chunk_k); break;
      }
    }
  };
  cpu::parallel_chunks(chunks, threads, body);
}

void linear_cpu(const LinearArgs& a) { linear_group_cpu(&a, 1); }

int linear_prefetch_steps(int steps) { return steps < 0 ? g_prefetch_steps.load() : g_prefetch_steps.exchange(steps); }

int linear_avx2_chunk_steps(bool sixteen_bit, int steps) {
  std::atomic<int>& chunk = g_avx2_chunk_steps[sixteen_bit ? 1 : 0];
  return steps < 1 ? chunk.load() : chunk.exchange(steps);
}

}  // namespace dspec
