// token_stats on the CPU: the same online algorithm as the CUDA / Triton kernels.
//
// Each row (or column chunk of a row) is scanned by kLanes interleaved lanes
// (lane l owns columns l, l + kLanes, ...), each with its own online state (float sums,
// flushed into a double-precision state every kRoundsPerFlush rounds); chunks of one row
// are merged in column order.  The lane loop is branch-free (own exp, dtype.h decoding)
// so the compiler vectorises it; on x86-64 it is also compiled for AVX2+FMA.  Large inputs
// (rows * vocab >= 2^18) are spread over std::thread workers (no OpenMP; at most
// $DSPEC_CPU_THREADS or hardware_concurrency() of them); the caller releases the GIL.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "dspec.h"
#include "dtype.h"

namespace dspec {
namespace {

using cpu::exp_nonpos;

constexpr int kLanes = 16;
using State = ts::StateT<double>;  // float max / exps, double sums (see dspec.h)
// Below this many elements a call runs on the calling thread alone.
constexpr std::int64_t kParallelThreshold = std::int64_t(1) << 18;
// Each worker gets at least this many elements.
constexpr std::int64_t kMinElementsPerThread = std::int64_t(1) << 16;

// kLanes interleaved online states (structure of arrays, float sums).  Every
// kRoundsPerFlush rounds (kLanes columns each) they are merged into a double-precision
// running state and reset, so a float sum never folds more than kRoundsPerFlush terms.
constexpr int kRoundsPerFlush = 256;

struct alignas(64) Lanes {
  float m1[kLanes];
  float m2[kLanes];
  float s[kLanes];
  float a[kLanes];
  std::int32_t i1[kLanes];
  std::int32_t nan[kLanes];
};

DSPEC_CPU_INLINE void reset(Lanes& L) {
  for (int l = 0; l < kLanes; ++l) {
    L.m1[l] = -INFINITY;
    L.m2[l] = -INFINITY;
    L.s[l] = 0.0f;
    L.a[l] = 0.0f;
    L.i1[l] = INT32_MAX;
    L.nan[l] = 0;
  }
}

// Fold one round: columns col0 + l for l < kLanes; xv holds their values (-inf padding past
// the end of the range).  Same arithmetic as dspec::ts::update, lane by lane.
DSPEC_CPU_INLINE void fold_round(Lanes& L, const float* xv, std::int32_t col0, float inv_t) {
  for (int l = 0; l < kLanes; ++l) {
    float x = xv[l];
    const bool is_nan = x != x;
    L.nan[l] += is_nan ? 1 : 0;
    x = is_nan ? -INFINITY : x;
    const float m1 = L.m1[l], s = L.s[l], a = L.a[l];
    const bool live = x > -INFINITY;
    const bool gt = x > m1;
    const float diff = (gt ? m1 - x : x - m1) * inv_t;
    const float ex = exp_nonpos(diff);
    const float e = live ? ex : 0.0f;
    const float s_gt = s * e + 1.0f;
    const float a_gt = e > 0.0f ? e * (a + diff * s) : 0.0f;
    const float s_le = s + e;
    const float a_le = a + (e > 0.0f ? e * diff : 0.0f);
    L.s[l] = live ? (gt ? s_gt : s_le) : s;
    L.a[l] = live ? (gt ? a_gt : a_le) : a;
    L.m2[l] = gt ? m1 : (L.m2[l] > x ? L.m2[l] : x);
    L.i1[l] = gt ? col0 + l : L.i1[l];
    L.m1[l] = gt ? x : m1;
  }
}

DSPEC_CPU_INLINE void flush(Lanes& L, State& run, float inv_t) {
  for (int l = 0; l < kLanes; ++l) {
    State st;
    st.m1 = L.m1[l];
    st.m2 = L.m2[l];
    st.s = L.s[l];
    st.a = L.a[l];
    st.i1 = L.i1[l];
    st.nan = L.nan[l];
    run = ts::merge(run, st, inv_t);
  }
  reset(L);
}

// State of columns [lo, hi) of the row starting at p.
template <int DT>
DSPEC_CPU_INLINE State scan_impl(const dt::elem_t<DT>* p, std::int64_t lo, std::int64_t hi, float inv_t) {
    State run = ts::identity<double>();
  Lanes L;
  reset(L);
  alignas(64) float xv[kLanes];
  std::int64_t j = lo;
  while (j + kLanes <= hi) {
    const std::int64_t rounds = std::min<std::int64_t>(kRoundsPerFlush, (hi - j) / kLanes);
    for (std::int64_t r = 0; r < rounds; ++r, j += kLanes) {
      for (int l = 0; l < kLanes; ++l) xv[l] = dt::to_float<DT>(p[j + l]);
      fold_round(L, xv, static_cast<std::int32_t>(j), inv_t);
    }
    flush(L, run, inv_t);
  }
  if (j < hi) {
    for (int l = 0; l < kLanes; ++l) xv[l] = j + l < hi ? dt::to_float<DT>(p[j + l]) : -INFINITY;
    fold_round(L, xv, static_cast<std::int32_t>(j), inv_t);
    flush(L, run, inv_t);
  }
  return run;
}

// One entry point per dtype, compiled for AVX2+FMA and baseline x86-64 (picked at load
// time by the ifunc resolver) where the compiler supports it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__ELF__)
#define DSPEC_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DSPEC_CPU_CLONES
#endif

DSPEC_CPU_CLONES State scan_f32(const void* p, std::int64_t lo, std::int64_t hi, float inv_t) {
  return scan_impl<kFloat32>(static_cast<const float*>(p), lo, hi, inv_t);
}
DSPEC_CPU_CLONES State scan_f16(const void* p, std::int64_t lo, std::int64_t hi, float inv_t) {
  return scan_impl<kFloat16>(static_cast<const std::uint16_t*>(p), lo, hi, inv_t);
}
DSPEC_CPU_CLONES State scan_bf16(const void* p, std::int64_t lo, std::int64_t hi, float inv_t) {
  return scan_impl<kBFloat16>(static_cast<const std::uint16_t*>(p), lo, hi, inv_t);
}

template <int DT>
State scan(const dt::elem_t<DT>* p, std::int64_t lo, std::int64_t hi, float inv_t) {
  if constexpr (DT == kFloat32) {
    return scan_f32(p, lo, hi, inv_t);
  } else if constexpr (DT == kFloat16) {
    return scan_f16(p, lo, hi, inv_t);
  } else {
    return scan_bf16(p, lo, hi, inv_t);
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
    threads = std::min<std::int64_t>(max_threads(), std::max<std::int64_t>(1, work / kMinElementsPerThread));
  }
  if (threads <= 1) {
    for (std::int64_t r = 0; r < rows; ++r) write_row(a, r, scan<DT>(logits + r * a.row_stride, 0, vocab, a.inv_t));
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
  const std::int64_t row_stride = a.row_stride;
  parallel_for(static_cast<int>(threads), [&](int t) {
    const std::int64_t u0 = units * t / threads, u1 = units * (t + 1) / threads;
    for (std::int64_t u = u0; u < u1; ++u) {
      const std::int64_t r = u / chunks, c = u % chunks;
      const std::int64_t lo = c * chunk_cols, hi = std::min(vocab, lo + chunk_cols);
      partial[static_cast<std::size_t>(u)] = scan<DT>(logits + r * row_stride, lo, hi, inv_t);
    }
  });
  for (std::int64_t r = 0; r < rows; ++r) {
    State st = partial[static_cast<std::size_t>(r * chunks)];
    for (std::int64_t c = 1; c < chunks; ++c) st = ts::merge(st, partial[static_cast<std::size_t>(r * chunks + c)], inv_t);
    write_row(a, r, st);
  }
}

}  // namespace

void token_stats_cpu(const TokenStatsArgs& args) {
  if (args.rows <= 0) return;
  switch (args.dtype) {
    case kFloat32:
      run<kFloat32>(args);
      break;
    case kFloat16:
      run<kFloat16>(args);
      break;
    case kBFloat16:
      run<kBFloat16>(args);
      break;
    default:
      break;  // unreachable: validated by the bindings
  }
}

}  // namespace dspec
