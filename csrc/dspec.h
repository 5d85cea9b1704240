// dspec._C: declarations shared by the C++ CPU code, the CUDA kernels and the bindings.
//
// This header is plain C++17: it includes no CUDA and no pybind11 header, so bindings.cpp
// and the *_cpu.cpp files compile with the host compiler alone.  The per-element algorithm
// of token_stats (update / merge / finalize) lives here as host+device inline functions so
// the CPU code and the CUDA kernels run literally the same arithmetic.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DSPEC_HD __host__ __device__ __forceinline__
#else
#define DSPEC_HD inline
#endif

namespace dspec {

// dtype codes of the logits (raw IEEE half / bfloat16 bit patterns for the 16-bit ones).
enum DTypeCode : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
// dtype codes of token ids and indices (draft tokens, tree tokens, parents; the masks ops'
// kIndexInt32 / kIndexInt64 of masks.h are the same codes).
enum IdTypeCode : int { kInt32 = 0, kInt64 = 1 };

// CUDA launch geometry of token_stats.  A vocabulary split covers a whole number of tiles
// of kTokenStatsTile columns (512 threads x 8 elements): cols_per_split =
// ceil(ceil(vocab / kTokenStatsTile) / num_splits) * kTokenStatsTile.
constexpr int kTokenStatsThreads = 512;
constexpr int kTokenStatsTile = 4096;
// One partial state of a split: 4 floats (m1, m2, S, A) + 2 int32 (index, NaN count).
constexpr std::int64_t kTokenStatsPartialBytes = 24;

struct TokenStatsArgs {
  const void* logits = nullptr;  // rows x vocab, unit stride along vocab
  int dtype = kFloat32;
  std::int64_t rows = 0;
  std::int64_t vocab = 0;
  std::int64_t row_stride = 0;  // elements between rows
  float inv_t = 1.0f;           // 1 / temperature
  std::int64_t* token = nullptr;
  float* prob = nullptr;
  float* margin = nullptr;
  float* entropy = nullptr;
  float* lse = nullptr;
  std::int64_t num_splits = 1;
  void* workspace = nullptr;  // rows * num_splits * kTokenStatsPartialBytes when num_splits > 1
  // CPU: only `token` is wanted (greedy verification): no exp pass; prob / margin / entropy /
  // lse are then written but meaningless.  The CUDA kernels compute everything anyway.
  bool argmax_only = false;
  int num_threads = 1;  // CPU: at most this many threads (the caller's count)
};

// Bytes of workspace the CUDA launcher needs (0 when num_splits == 1).  Arguments are
// assumed validated (rows >= 0, num_splits >= 1).
inline std::int64_t token_stats_workspace_bytes(std::int64_t rows, std::int64_t num_splits) {
  return num_splits > 1 ? rows * num_splits * kTokenStatsPartialBytes : 0;
}

// Both assume validated arguments (see bindings.cpp) and rows >= 1.
void token_stats_cpu(const TokenStatsArgs& args);
// Row `row` of args alone, on the calling thread, scanned whole: the values token_stats_cpu
// gives that row in any call of at least as many rows as threads (verification's lazy rows).
// next_row >= 0: a row the caller reads next, brought into L2 while this row's exps run.
void token_stats_row_cpu(const TokenStatsArgs& args, std::int64_t row, std::int64_t next_row = -1);
// Launches on `stream` (a cudaStream_t passed as an integer) on the current CUDA device.
// Throws std::runtime_error with cudaGetErrorString if the launch fails.  Defined only when
// the module is built with CUDA (DSPEC_WITH_CUDA).
void token_stats_cuda(const TokenStatsArgs& args, std::int64_t stream);

namespace ts {

// Online state over a set of elements of one row (see dspec/kernels/token_stats.py):
// m1 running max, i1 its column (lowest on ties), m2 runner-up (== m1 on ties),
// s = sum exp((x - m1) * inv_t), a = sum exp((x - m1) * inv_t) * (x - m1) * inv_t,
// nan = number of NaNs seen (NaNs then count as -inf).
// Acc is the type of the two sums: float in the CUDA kernels (as in Triton), double in the
// CPU code, whose lanes each fold far more elements than a GPU thread does (a float sum
// over ~10^4 terms drifts by ~1e-4 relative; the exps themselves stay float).
template <typename Acc>
struct StateT {
  float m1;
  float m2;
  Acc s;
  Acc a;
  std::int32_t i1;
  std::int32_t nan;
};
using State = StateT<float>;

DSPEC_HD float log_acc(float v) { return logf(v); }
DSPEC_HD double log_acc(double v) { return log(v); }

template <typename Acc = float>
DSPEC_HD StateT<Acc> identity() {
  StateT<Acc> st;
  st.m1 = -INFINITY;
  st.m2 = -INFINITY;
  st.s = Acc(0);
  st.a = Acc(0);
  st.i1 = INT32_MAX;
  st.nan = 0;
  return st;
}

// Fold element x (column col) into st.  Elements of one state must come in increasing
// column order (a later equal value does not replace the max).  One exp per element:
// whichever of (running max, x) is smaller is rescaled.
template <typename Acc>
DSPEC_HD void update(StateT<Acc>& st, float x, std::int32_t col, float inv_t) {
  const bool is_nan = x != x;
  st.nan += is_nan ? 1 : 0;
  x = is_nan ? -INFINITY : x;
  const bool live = x > -INFINITY;
  const bool gt = x > st.m1;
  const float diff = (gt ? st.m1 - x : x - st.m1) * inv_t;
  const float e = live ? expf(diff) : 0.0f;
  const Acc s_gt = st.s * Acc(e) + Acc(1);
  // e == 0 covers m1 == -inf (nothing folded yet) and an underflowed or overflowed
  // (x - m1) * inv_t, where e * (a + diff * s) would be 0 * inf = NaN.
  const Acc a_gt = e > 0.0f ? Acc(e) * (st.a + Acc(diff) * st.s) : Acc(0);
  const Acc s_le = st.s + Acc(e);
  const Acc a_le = st.a + (e > 0.0f ? Acc(e) * Acc(diff) : Acc(0));
  st.s = live ? (gt ? s_gt : s_le) : st.s;
  st.a = live ? (gt ? a_gt : a_le) : st.a;
  st.m2 = gt ? st.m1 : fmaxf(st.m2, x);
  st.i1 = gt ? col : st.i1;
  st.m1 = gt ? x : st.m1;
}

// Combine two states over disjoint element sets.  Symmetric: merge(a, b) == merge(b, a)
// bit for bit (the winner is chosen by value, ties to the lower index).
template <typename Acc>
DSPEC_HD StateT<Acc> merge(const StateT<Acc>& x, const StateT<Acc>& y, float inv_t) {
  // field-wise selects (no reference to a selected struct: keeps CUDA states in registers)
  const bool x_wins = x.m1 > y.m1 || (x.m1 == y.m1 && x.i1 <= y.i1);
  const float w_m1 = x_wins ? x.m1 : y.m1, l_m1 = x_wins ? y.m1 : x.m1;
  const float w_m2 = x_wins ? x.m2 : y.m2;
  const Acc w_s = x_wins ? x.s : y.s, l_s = x_wins ? y.s : x.s;
  const Acc w_a = x_wins ? x.a : y.a, l_a = x_wins ? y.a : x.a;
  StateT<Acc> r;
  r.m1 = w_m1;
  r.i1 = x_wins ? x.i1 : y.i1;
  r.m2 = fmaxf(w_m2, l_m1);
  const bool live = l_m1 > -INFINITY;
  const float d = (l_m1 - w_m1) * inv_t;
  const Acc c = live ? Acc(expf(d)) : Acc(0);
  r.s = w_s + (live ? c * l_s : Acc(0));
  r.a = w_a + (c > Acc(0) ? c * (l_a + Acc(d) * l_s) : Acc(0));  // c == 0: d may be -inf
  r.nan = x.nan + y.nan;
  return r;
}

struct Result {
  std::int64_t token;
  float prob;
  float margin;
  float entropy;
  float lse;
};

// Invalid rows (a NaN, a +inf, or only -inf): token -1, prob = margin = entropy = NaN,
// lse NaN if a NaN was seen, else m1 (+inf or -inf).
template <typename Acc>
DSPEC_HD Result finalize(const StateT<Acc>& st, float inv_t) {
  const bool valid = st.nan == 0 && INFINITY > st.m1 && st.m1 > -INFINITY;
  const Acc log_s = log_acc(st.s);
  Result r;
  r.token = valid ? static_cast<std::int64_t>(st.i1) : std::int64_t(-1);
  r.prob = valid ? static_cast<float>(Acc(1) / st.s) : NAN;
  r.margin = valid ? static_cast<float>(Acc(1.0f - expf((st.m2 - st.m1) * inv_t)) / st.s) : NAN;
  r.entropy = valid ? static_cast<float>(log_s - st.a / st.s) : NAN;
  r.lse = valid ? static_cast<float>(Acc(st.m1 * inv_t) + log_s) : (st.nan > 0 ? NAN : st.m1);
  return r;
}

}  // namespace ts
}  // namespace dspec
