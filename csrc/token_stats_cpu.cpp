// token_stats on the CPU: the same online algorithm as the CUDA / Triton kernels.
//
// Each row (or column chunk of a row) is scanned in two passes by kLanes interleaved lanes
// (see scan_impl); the chunks of one row are merged with the online merge (ts::merge).
// The lane loops are branch-free (own exp, dtype.h decoding) so the compiler vectorises
// them; on x86-64 they are also compiled for AVX2+FMA and AVX-512.  Large inputs
// (rows * vocab >= 2^18) are spread over the persistent pool of cpu_parallel.h (no OpenMP;
// at most $DSPEC_CPU_THREADS or hardware_concurrency() threads); the caller releases the GIL.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_features.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "dspec.h"
#include "dtype.h"

namespace dspec {
namespace {

constexpr int kLanes = 16;
using State = ts::StateT<double>;  // float max / exps, double sums (see dspec.h)
// Below this many elements a call runs on the calling thread alone.
constexpr std::int64_t kParallelThreshold = std::int64_t(1) << 18;
// Each worker gets at least this many elements.
constexpr std::int64_t kMinElementsPerThread = std::int64_t(1) << 16;

// Two passes over a chunk of a row, each in kLanes interleaved lanes (lane l owns columns
// l, l + kLanes, ...; branch-free, so they vectorise).  Pass 1 finds the max, its column,
// the runner-up and the NaNs: compares only.  Pass 2 sums exp((x - max) * inv_t) and the
// entropy term against that fixed max: one exp and two adds per element, where the online
// update of dspec::ts::update rescales on every new max with selects around it (about 3x
// the work).  The chunk is re-read from cache (a row of 49152 floats is 192 KiB), so
// memory traffic stays one read.  Float lane sums go into double sums every
// kRoundsPerFlush rounds, so a float sum never folds more than that many terms.
constexpr int kRoundsPerFlush = 256;

// Pass 1's fold of x (NaN counted, then taken as -inf) into one lane.
DSPEC_CPU_INLINE void fold_max(float raw, std::int32_t col, float& m1, float& m2, std::int32_t& i1, std::int32_t& nan) {
  nan += raw != raw ? 1 : 0;
  const float x = raw != raw ? -INFINITY : raw;
  const bool gt = x > m1;
  m2 = gt ? m1 : (m2 > x ? m2 : x);
  i1 = gt ? col : i1;
  m1 = gt ? x : m1;
}

// Pass 2's fold of x into one lane's sums against the chunk's finite max top.  No branch
// around the exp (so the loop vectorises): -inf and NaN give d = -inf or NaN and e = 0,
// and d is clamped where e = 0 anyway, so that e * d never is 0 * inf.
DSPEC_CPU_INLINE void fold_sum(float x, float top, float inv_t, float& s, float& a) {
  const float d = (x - top) * inv_t;  // <= 0
  const float e = cpu::exp_nonpos(d);
  s += e;
  a += e * (d > -128.0f ? d : -128.0f);
}

// The state of pass 1's lanes (sums still 0): the winner by value, ties to the lower column.
DSPEC_CPU_INLINE State lanes_state(const float* m1, const float* m2, const std::int32_t* i1, const std::int32_t* nan,
                                   float inv_t) {
  State run = ts::identity<double>();
  for (int l = 0; l < kLanes; ++l) {
    State st = ts::identity<double>();
    st.m1 = m1[l];
    st.m2 = m2[l];
    st.i1 = i1[l];
    st.nan = nan[l];
    run = ts::merge(run, st, inv_t);
  }
  return run;
}

// State of the n float32 values at p, columns col0, col0 + 1, ... of a row (without
// `sums`: pass 1 only, the sums left 0).
DSPEC_CPU_INLINE State scan_floats(const float* p, std::int64_t n, std::int64_t col0, float inv_t, bool sums) {
  const std::int64_t lo = 0, hi = n;
  alignas(64) float m1[kLanes], m2[kLanes];
  alignas(64) std::int32_t i1[kLanes], nan[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    m1[l] = m2[l] = -INFINITY;
    i1[l] = INT32_MAX;
    nan[l] = 0;
  }
  const std::int64_t body = lo + (hi - lo) / kLanes * kLanes;
  for (std::int64_t j = lo; j < body; j += kLanes) {
    for (int l = 0; l < kLanes; ++l)
      fold_max(p[j + l], static_cast<std::int32_t>(col0 + j + l), m1[l], m2[l], i1[l], nan[l]);
  }
  for (std::int64_t j = body; j < hi; ++j) {
    const int l = static_cast<int>(j - body);
    fold_max(p[j], static_cast<std::int32_t>(col0 + j), m1[l], m2[l], i1[l], nan[l]);
  }
  State run = lanes_state(m1, m2, i1, nan, inv_t);
  const float top = run.m1;
  if (!sums || !(top > -INFINITY)) return run;  // nothing but -inf / NaN: both sums are 0
  alignas(64) float s[kLanes], a[kLanes];
  double s_sum = 0.0, a_sum = 0.0;
  for (std::int64_t j = lo; j < body;) {
    for (int l = 0; l < kLanes; ++l) s[l] = a[l] = 0.0f;
    const std::int64_t stop = std::min<std::int64_t>(body, j + std::int64_t(kRoundsPerFlush) * kLanes);
    for (; j < stop; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) fold_sum(p[j + l], top, inv_t, s[l], a[l]);
    }
    for (int l = 0; l < kLanes; ++l) {
      s_sum += s[l];
      a_sum += a[l];
    }
  }
  for (std::int64_t j = body; j < hi; ++j) {
    float s1 = 0.0f, a1 = 0.0f;
    fold_sum(p[j], top, inv_t, s1, a1);
    s_sum += s1;
    a_sum += a1;
  }
  run.s = s_sum;
  run.a = a_sum;
  return run;
}

// The float32 scan and the 16-bit dtypes' conversion to float32, each compiled for
// AVX-512, AVX2 + FMA and baseline x86-64 (DSPEC_CPU_MULTI).  A 16-bit chunk is first
// widened into a per-thread float32 buffer (at most one row, in L2) and scanned there: one
// simple conversion loop and one float32 scan vectorise where the fused loop did not.
DSPEC_CPU_MULTI(State, scan_f32, (const float* p, std::int64_t n, std::int64_t col0, float inv_t, bool sums),
                (p, n, col0, inv_t, sums)) {
  return scan_floats(p, n, col0, inv_t, sums);
}

template <int DT>
DSPEC_CPU_INLINE void widen(const std::uint16_t* p, std::int64_t n, float* out) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = dt::to_float<DT>(p[i]);
}
DSPEC_CPU_MULTI(void, widen_f16, (const std::uint16_t* p, std::int64_t n, float* out), (p, n, out)) {
  widen<kFloat16>(p, n, out);
}
DSPEC_CPU_MULTI(void, widen_bf16, (const std::uint16_t* p, std::int64_t n, float* out), (p, n, out)) {
  widen<kBFloat16>(p, n, out);
}

#if DSPEC_AVX512_CODE
// The same two passes written for AVX-512.  Pass 1 (max, column, runner-up, NaNs) gives
// scan_floats' values (a max or runner-up of 0 may carry the other sign of zero): on integer
// keys (max_by_keys), or on float compares with 16 lanes where a chunk holds a NaN.  16-bit
// elements widen in the load (no buffer pass).  Pass 2 takes exp(d) as 2^(d log2 e)
// (exp2_nonpos' polynomial with fused multiply-adds, 2^n by vscalefps) and sums
// e * (d log2 e), scaled by ln 2 once per chunk:
// the same quantities as the portable code, rounded differently in the last bits.
// Memory: pass 1 prefetches cpu::kStreamAhead bytes ahead of its loads, and pass 2, which
// re-reads the chunk from L2 and is exp-bound, brings the thread's next chunk into L2.
// At 1088 rows x 49152 (2 threads, Xeon with AVX-512, Nov 2026, the rows in its 300 MiB L3
// from the rep before) the portable loops read 7-10 GB/s, these 11-26 GB/s; from memory
// (bench_logits_cpu flushes the caches) 8-14 GB/s against a DRAM read of ~25 GB/s.  With the
// key pass, bf16: 9.2 -> 6.2 ms from L3, 13.3 -> 9.6-10 ms from memory; the
// rest from memory is the exp pass's wait on the next chunk (its prefetch rate, one line per
// ~20 cycles of exps, is about what one core's outstanding misses sustain).

// Pass 1 on the elements' sortable integer keys (cpu::Keys): the max, the runner-up and a
// NaN check take integer max / min on 512 / w lanes at once, about 3 vector operations per
// 16 elements where the float compares and column selects took 10, with no loop-carried
// compare (pass 1 over 1088 x 49152 bf16 was ~40 % of token_stats' time).  The max's column
// is found afterwards by a scan for its bits that stops at the first match.  False (st
// untouched) when the chunk holds a NaN: the float pass below counts them.
template <int DT>
DSPEC_AVX512 bool max_by_keys(const dt::elem_t<DT>* p, std::int64_t n, std::int64_t col0, State& st) {
  using K = cpu::Keys<DT>;
  constexpr int kPer = K::kPer;
  const __m512i neg_inf = K::set1(K::kNegInfKey);
  __m512i m1 = neg_inf, m2 = neg_inf, lo = K::set1(K::kPosInf);
  const std::int64_t body = n / kPer * kPer;
  for (std::int64_t j = 0; j < body; j += kPer) {
    _mm_prefetch(reinterpret_cast<const char*>(p + j) + cpu::kStreamAhead, _MM_HINT_T0);
    const __m512i k = K::key(_mm512_loadu_si512(p + j));
    m2 = K::max(m2, K::min(m1, k));
    m1 = K::max(m1, k);
    lo = K::min(lo, k);
  }
  if (body < n) {
    const std::uint64_t in = K::first(n - body);
    const __m512i k = K::key(K::load(p + body, in));
    m2 = K::mask_max(m2, in, m2, K::min(m1, k));
    m1 = K::mask_max(m1, in, m1, k);
    lo = K::mask_min(lo, in, lo, k);
  }
  using Lane = std::conditional_t<DT == kFloat32, std::int32_t, std::int16_t>;
  alignas(64) Lane l1[kPer], l2[kPer], llo[kPer];
  _mm512_store_si512(l1, m1);
  _mm512_store_si512(l2, m2);
  _mm512_store_si512(llo, lo);
  std::int64_t top = K::kNegInfKey, runner = K::kNegInfKey, least = K::kPosInf;
  for (int l = 0; l < kPer; ++l) {  // the two largest of the lanes' m1, and their m2
    const std::int64_t a = l1[l];
    runner = std::max(runner, std::max<std::int64_t>(l2[l], std::min(top, a)));
    top = std::max(top, a);
    least = std::min<std::int64_t>(least, llo[l]);
  }
  if (top > K::kPosInf || least < K::kNegInfKey) return false;  // a NaN
  st = ts::identity<double>();
  st.m1 = cpu::key_value<DT>(top);
  st.m2 = cpu::key_value<DT>(runner);
  if (!(st.m1 > -INFINITY)) return true;  // every element -inf: no column, as the float pass
  // the first column equal to the max (+0 and -0 equal)
  const bool is_zero = st.m1 == 0.0f;
  const __m512i want = K::key(K::set1(top));  // the max's bits
  for (std::int64_t j = 0; j < n; j += kPer) {
    const std::uint64_t in = K::first(n - j);
    const __m512i v = K::load(p + j, in);
    const std::uint64_t hit = (is_zero ? K::zero(v) : K::eq(v, want)) & in;
    if (hit != 0) {
      st.i1 = static_cast<std::int32_t>(col0 + j + __builtin_ctzll(hit));
      return true;
    }
  }
  return true;  // unreachable: the max is one of the elements
}

// Pass 1 on float compares: max, column, runner-up and the NaN count.
template <int DT>
DSPEC_AVX512 State max_by_floats(const dt::elem_t<DT>* p, std::int64_t n, std::int64_t col0, float inv_t) {
  const std::int64_t body = n / kLanes * kLanes;
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 m1 = neg_inf, m2 = neg_inf;
  __m512i i1 = _mm512_set1_epi32(INT32_MAX), nan = _mm512_setzero_si512();
  __m512i col = _mm512_add_epi32(_mm512_set1_epi32(static_cast<std::int32_t>(col0)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i step = _mm512_set1_epi32(kLanes), one = _mm512_set1_epi32(1);
  for (std::int64_t j = 0; j < body; j += kLanes) {  // fold_max on 16 lanes
    _mm_prefetch(reinterpret_cast<const char*>(p + j) + cpu::kStreamAhead, _MM_HINT_T0);
    const __m512 x = cpu::load_f32<DT>(p + j, 0xFFFF);
    // a NaN compares false, so it changes nothing below: fold_max's NaN -> -inf is implicit
    nan = _mm512_mask_add_epi32(nan, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan, one);
    const __mmask16 gt = _mm512_cmp_ps_mask(x, m1, _CMP_GT_OQ);
    m2 = _mm512_mask_mov_ps(_mm512_max_ps(x, m2), gt, m1);  // max_ps(x, m2) = x > m2 ? x : m2
    i1 = _mm512_mask_mov_epi32(i1, gt, col);
    m1 = _mm512_mask_mov_ps(m1, gt, x);
    col = _mm512_add_epi32(col, step);
  }
  alignas(64) float lm1[kLanes], lm2[kLanes];
  alignas(64) std::int32_t li1[kLanes], lnan[kLanes];
  _mm512_store_ps(lm1, m1);
  _mm512_store_ps(lm2, m2);
  _mm512_store_si512(li1, i1);
  _mm512_store_si512(lnan, nan);
  for (std::int64_t j = body; j < n; ++j) {
    const int l = static_cast<int>(j - body);
    fold_max(dt::to_float<DT>(p[j]), static_cast<std::int32_t>(col0 + j), lm1[l], lm2[l], li1[l], lnan[l]);
  }
  return lanes_state(lm1, lm2, li1, lnan, inv_t);
}

template <int DT>
DSPEC_AVX512 State scan_avx512(const dt::elem_t<DT>* p, std::int64_t n, std::int64_t col0, float inv_t, bool sums,
                               const dt::elem_t<DT>* next) {
  State run;
  if (!max_by_keys<DT>(p, n, col0, run)) run = max_by_floats<DT>(p, n, col0, inv_t);
  const float top = run.m1;
  if (!sums || !(top > -INFINITY)) return run;
  const std::int64_t body = n / kLanes * kLanes;
  constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;
  const __m512 vtop = _mm512_set1_ps(top), vscale = _mm512_set1_ps(inv_t * kLog2e);
  double s_sum = 0.0, a_sum = 0.0;
  alignas(64) float ls[kLanes], la[kLanes];
  for (std::int64_t j = 0; j < body;) {  // fold_sum on 16 lanes, in base 2
    __m512 s = _mm512_setzero_ps(), a = _mm512_setzero_ps();
    const std::int64_t stop = std::min<std::int64_t>(body, j + std::int64_t(kRoundsPerFlush) * kLanes);
    for (; j < stop; j += kLanes) {
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + j), _MM_HINT_T1);
      const __m512 t = _mm512_mul_ps(_mm512_sub_ps(cpu::load_f32<DT>(p + j, 0xFFFF), vtop), vscale);
      __m512 tc;
      const __m512 e = cpu::exp2_nonpos16(t, &tc);
      s = _mm512_add_ps(s, e);
      a = _mm512_fmadd_ps(e, tc, a);  // tc: t above 2^-126 (where e > 0), finite elsewhere
    }
    _mm512_store_ps(ls, s);
    _mm512_store_ps(la, a);
    double a_chunk = 0.0;
    for (int l = 0; l < kLanes; ++l) {
      s_sum += ls[l];
      a_chunk += la[l];
    }
    a_sum += a_chunk * kLn2;
  }
  for (std::int64_t j = body; j < n; ++j) {
    float s1 = 0.0f, a1 = 0.0f;
    fold_sum(dt::to_float<DT>(p[j]), top, inv_t, s1, a1);
    s_sum += s1;
    a_sum += a1;
  }
  run.s = s_sum;
  run.a = a_sum;
  return run;
}
#endif

// State of columns [lo, hi) of the row starting at p.
template <int DT>
State scan(const dt::elem_t<DT>* p, std::int64_t lo, std::int64_t hi, float inv_t, bool sums,
           const dt::elem_t<DT>* next = nullptr) {
#if DSPEC_AVX512_CODE
  if (cpu::has_avx512()) return scan_avx512<DT>(p + lo, hi - lo, lo, inv_t, sums, next);
#endif
  if constexpr (DT == kFloat32) {
    return scan_f32(p + lo, hi - lo, lo, inv_t, sums);
  } else {
    thread_local std::vector<float> wide;
    if (static_cast<std::int64_t>(wide.size()) < hi - lo) wide.resize(static_cast<std::size_t>(hi - lo));
    if constexpr (DT == kFloat16) {
      widen_f16(p + lo, hi - lo, wide.data());
    } else {
      widen_bf16(p + lo, hi - lo, wide.data());
    }
    return scan_f32(wide.data(), hi - lo, lo, inv_t, sums);
  }
}

inline void write_row(const TokenStatsArgs& a, std::int64_t row, const State& st) {
  const ts::Result r = ts::finalize(st, a.inv_t);
  a.token[row] = r.token;
  a.prob[row] = r.prob;
  a.margin[row] = r.margin;
  a.entropy[row] = r.entropy;
  a.lse[row] = r.lse;
}

// Row r of a, whole, on the calling thread.
template <int DT>
void scan_row(const TokenStatsArgs& a, std::int64_t r, std::int64_t next_row = -1) {
  const auto* logits = static_cast<const dt::elem_t<DT>*>(a.logits);
  write_row(a, r,
            scan<DT>(logits + r * a.row_stride, 0, a.vocab, a.inv_t, !a.argmax_only,
                     next_row >= 0 ? logits + next_row * a.row_stride : nullptr));
}

using cpu::max_threads;
using cpu::parallel_for;

template <int DT>
void run(const TokenStatsArgs& a) {
  using T = dt::elem_t<DT>;
  const T* logits = static_cast<const T*>(a.logits);
  const std::int64_t rows = a.rows, vocab = a.vocab;
  const std::int64_t work = rows * vocab;  // no overflow: validated by the bindings

  std::int64_t threads = 1;
  if (work >= kParallelThreshold) {
    threads = std::min<std::int64_t>({static_cast<std::int64_t>(max_threads()), std::max(a.num_threads, 1),
                                      std::max<std::int64_t>(1, work / kMinElementsPerThread)});
  }
  if (threads <= 1) {
    for (std::int64_t r = 0; r < rows; ++r) scan_row<DT>(a, r);
    return;
  }

  // Work units: (row, chunk).  With fewer rows than threads, rows are cut into column
  // chunks (multiples of kLanes) so every thread gets work.
  std::int64_t chunks = rows >= threads ? 1 : (threads + rows - 1) / rows;
  std::int64_t chunk_cols = (vocab + chunks - 1) / chunks;
  chunk_cols = (chunk_cols + kLanes - 1) / kLanes * kLanes;
  chunks = (vocab + chunk_cols - 1) / chunk_cols;
  const std::int64_t units = rows * chunks;
  threads = std::min(threads, units);

  std::vector<State> partial(static_cast<std::size_t>(units));
  const float inv_t = a.inv_t;
  const bool sums = !a.argmax_only;
  const std::int64_t row_stride = a.row_stride;
  parallel_for(static_cast<int>(threads), [&](int t) {
    const std::int64_t u0 = units * t / threads, u1 = units * (t + 1) / threads;
    for (std::int64_t u = u0; u < u1; ++u) {
      const std::int64_t r = u / chunks, c = u % chunks;
      const std::int64_t lo = c * chunk_cols, hi = std::min(vocab, lo + chunk_cols);
      const T* next = nullptr;
      if (u + 1 < u1) {
        const std::int64_t rn = (u + 1) / chunks, cn = (u + 1) % chunks;
        next = logits + rn * row_stride + cn * chunk_cols;
      }
      partial[static_cast<std::size_t>(u)] = scan<DT>(logits + r * row_stride, lo, hi, inv_t, sums, next);
    }
  });
  for (std::int64_t r = 0; r < rows; ++r) {
    State st = partial[static_cast<std::size_t>(r * chunks)];
    for (std::int64_t c = 1; c < chunks; ++c)
      st = ts::merge(st, partial[static_cast<std::size_t>(r * chunks + c)], inv_t);
    write_row(a, r, st);
  }
}

}  // namespace

void token_stats_row_cpu(const TokenStatsArgs& args, std::int64_t row, std::int64_t next_row) {
  switch (args.dtype) {
    case kFloat32: scan_row<kFloat32>(args, row, next_row); break;
    case kFloat16: scan_row<kFloat16>(args, row, next_row); break;
    case kBFloat16: scan_row<kBFloat16>(args, row, next_row); break;
    default: break;  // unreachable: validated by the bindings
  }
}

void token_stats_cpu(const TokenStatsArgs& args) {
  if (args.rows <= 0) return;
  switch (args.dtype) {
    case kFloat32: run<kFloat32>(args); break;
    case kFloat16: run<kFloat16>(args); break;
    case kBFloat16: run<kBFloat16>(args); break;
    default: break;  // unreachable: validated by the bindings
  }
}

}  // namespace dspec
