// token_stats CUDA kernels: argmax, top-1 / top-2 probability, entropy and logsumexp of
// each row of logits in one read.
//
// grid.x = rows * num_splits; block (row, split) streams columns
// [split * cols_per_split, min((split + 1) * cols_per_split, vocab)) of its row.  Every
// thread keeps the online state of dspec::ts (dspec.h) over the columns it owns, in
// increasing column order: 16-byte vector loads (4 fp32 / 8 fp16 or bf16) from the first
// 16-byte aligned column on, a scalar head before it and a scalar tail after the last whole
// vector.  States are merged with __shfl_xor_sync inside a warp, then across warps in
// shared memory.  With one split the block writes the outputs; otherwise it writes its
// partial state to the workspace and token_stats_merge_kernel (one warp per row) merges the
// splits of each row and writes the outputs.
//
// DSPEC_CUDA_SIM: tests/cuda_sim compiles this file as plain C++ with its host simulator of
// blocks, warps, shuffles and barriers (tests/cuda_sim/token_stats_sim.cpp), so the kernels
// and the launcher run without a GPU; kernels are launched through DSPEC_LAUNCH
// (cuda_launch.h) for that.
#include "cuda_launch.h"

#include <cstdint>
#include <stdexcept>

#include "dspec.h"
#include "dtype.h"

namespace dspec {
namespace {

using ts::State;

constexpr unsigned kFullMask = 0xffffffffu;

#define DSPEC_HDI __host__ __device__ __forceinline__

// Read-only 16-byte load (the logits are read once).  The simulator's __ldg checks the
// 16-byte alignment.
DSPEC_HDI uint4 load16(const uint4* p) {
#if defined(__CUDA_ARCH__) || defined(DSPEC_CUDA_SIM)
  return __ldg(p);
#else
  return *p;
#endif
}

// 2^x for x <= 0 (or NaN): the SFU's approximation on the GPU (relative error ~2^-22,
// results below 2^-126 flushed to 0), exp2f on the host simulator.
DSPEC_HDI float exp2_nonpos(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Fold N elements v[0..N) (columns col0, col0 + 1, ...) into st; the same state as N calls
// of ts::update, with one exp per element and the bookkeeping once per group.
// ts::update spends ~30 instructions per element (its select chains run for every element),
// which on an H100 made the kernel compute-bound at ~45 % of copy bandwidth.  Here the
// group's max M is taken first (N - 1 fmax): when it does not beat the running max -- almost
// always, past the first few groups -- an element costs a subtract, a multiply, an exp2 and
// two adds.  Only a group that holds a new max pays for its column and runner-up, and a
// group whose max is +-inf (or all -inf so far) takes the exact per-element path.  A NaN
// (skipped by fmaxf) makes the group's sum NaN, which counts it.
template <int N>
DSPEC_HDI void update_group(State& st, const float (&v)[N], std::int32_t col0, float inv_t, float inv_t_log2) {
  float group_max = v[0];
#pragma unroll
  for (int k = 1; k < N; ++k) group_max = fmaxf(group_max, v[k]);
  const float new_max = fmaxf(st.m1, group_max);
  if (!(fabsf(new_max) < INFINITY)) {
#pragma unroll
    for (int k = 0; k < N; ++k) ts::update(st, v[k], col0 + k, inv_t);
    return;
  }
  if (group_max > st.m1) {  // strictly: an equal later column does not take the max
    int idx = N - 1;
#pragma unroll
    for (int k = N - 2; k >= 0; --k) idx = v[k] == group_max ? k : idx;
    float runner = -INFINITY;
#pragma unroll
    for (int k = 0; k < N; ++k) runner = k == idx ? runner : fmaxf(runner, v[k]);
    if (st.s > 0.0f) {  // rescale the old sums to the new max (s == 0: nothing folded yet)
      const float d = (st.m1 - group_max) * inv_t;
      const float e = expf(d);
      st.a = e > 0.0f ? e * (st.a + d * st.s) : 0.0f;
      st.s *= e;
    }
    st.m2 = fmaxf(st.m1, runner);
    st.m1 = group_max;
    st.i1 = col0 + idx;
  } else {
    st.m2 = fmaxf(st.m2, group_max);
  }
  // a in log2 units here: sum e * d2 with d2 = (x - m1) * inv_t * log2(e); the clamp keeps
  // 0 * -inf (an x of -inf) out of it and changes nothing else (2^-256 is 0 in float).
  float s = 0.0f, a2 = 0.0f;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float d2 = (v[k] - st.m1) * inv_t_log2;
    const float e = exp2_nonpos(d2);
    s += e;
    a2 = fmaf(e, fmaxf(d2, -256.0f), a2);
  }
  st.nan += s != s ? 1 : 0;
  st.s += s;
  st.a = fmaf(a2, kLn2, st.a);
}

// Fold the kVec elements of one 16-byte vector (first column col0) into st, in order.
template <int DT>
DSPEC_HDI void update_vec(State& st, const uint4& raw, std::int32_t col0, float inv_t, float inv_t_log2) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (DT == kFloat32) {
    const float v[4] = {dt::f32_from_bits(w[0]), dt::f32_from_bits(w[1]), dt::f32_from_bits(w[2]),
                        dt::f32_from_bits(w[3])};
    update_group(st, v, col0, inv_t, inv_t_log2);
  } else {
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = dt::to_float<DT>(static_cast<std::uint16_t>(w[k] & 0xffffu));
      v[2 * k + 1] = dt::to_float<DT>(static_cast<std::uint16_t>(w[k] >> 16));
    }
    update_group(st, v, col0, inv_t, inv_t_log2);
  }
}

// The state of thread tid of a THREADS-thread block over columns [lo, hi) of the row that
// starts at row_base, in increasing column order: a scalar head up to the first 16-byte
// boundary (fewer than kVec elements, thread t takes head element t), whole 16-byte vectors
// (thread t takes vectors t, t + THREADS, ...; UNROLL loads in flight), then a scalar tail
// (fewer than kVec elements, thread t takes tail element t).  Host-callable so the mapping
// can be checked without a GPU.
template <int DT, int THREADS, int UNROLL>
DSPEC_HDI State thread_scan(const void* row_base, std::int64_t lo, std::int64_t hi, int tid, float inv_t) {
  using T = dt::elem_t<DT>;
  constexpr int kVec = static_cast<int>(16 / sizeof(T));  // per 16-byte vector: 4 fp32, 8 fp16 / bf16
  static_assert(kVec <= THREADS, "head and tail need one thread per element");
  State st = ts::identity();
  if (lo >= hi) return st;
  const float inv_t_log2 = inv_t * kLog2e;
  const T* p = static_cast<const T*>(row_base) + lo;
  const std::int64_t n = hi - lo;
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  // elements before the first 16-byte boundary (all of them if p is not element aligned)
  std::int64_t head = (addr % sizeof(T)) ? n : static_cast<std::int64_t>(((16u - (addr & 15u)) & 15u) / sizeof(T));
  head = head < n ? head : n;
  if (tid < head) ts::update(st, dt::to_float<DT>(p[tid]), static_cast<std::int32_t>(lo + tid), inv_t);

  const std::int64_t n_vec = (n - head) / kVec;
  const uint4* v = reinterpret_cast<const uint4*>(p + head);
  const std::int64_t col_v = lo + head;  // column of v[0]
  std::int64_t i = tid;
  for (; i + (UNROLL - 1) * THREADS < n_vec; i += UNROLL * THREADS) {
    uint4 raw[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) raw[k] = load16(v + i + k * THREADS);
#pragma unroll
    for (int k = 0; k < UNROLL; ++k)
      update_vec<DT>(st, raw[k], static_cast<std::int32_t>(col_v + (i + k * THREADS) * kVec), inv_t, inv_t_log2);
  }
  for (; i < n_vec; i += THREADS) {
    update_vec<DT>(st, load16(v + i), static_cast<std::int32_t>(col_v + i * kVec), inv_t, inv_t_log2);
  }

  const std::int64_t tail = head + n_vec * kVec;  // fewer than kVec elements left
  if (tail + tid < n) {
    ts::update(st, dt::to_float<DT>(p[tail + tid]), static_cast<std::int32_t>(lo + tail + tid), inv_t);
  }
  return st;
}

// Columns [lo, hi) of split `split` (cols_per_split is a whole number of tiles).
DSPEC_HDI void split_range(std::int64_t vocab, std::int64_t cols_per_split, std::int64_t split, std::int64_t& lo,
                           std::int64_t& hi) {
  lo = split * cols_per_split;
  hi = lo + cols_per_split < vocab ? lo + cols_per_split : vocab;
}

inline std::int64_t cols_per_split_for(std::int64_t vocab, std::int64_t num_splits) {
  const std::int64_t tiles = (vocab + kTokenStatsTile - 1) / kTokenStatsTile;
  return (tiles + num_splits - 1) / num_splits * kTokenStatsTile;
}

__device__ __forceinline__ State shfl_xor(const State& s, int offset) {
  State o;
  o.m1 = __shfl_xor_sync(kFullMask, s.m1, offset);
  o.m2 = __shfl_xor_sync(kFullMask, s.m2, offset);
  o.s = __shfl_xor_sync(kFullMask, s.s, offset);
  o.a = __shfl_xor_sync(kFullMask, s.a, offset);
  o.i1 = __shfl_xor_sync(kFullMask, s.i1, offset);
  o.nan = __shfl_xor_sync(kFullMask, s.nan, offset);
  return o;
}

// Every lane ends with the same merged state (merge is symmetric).
__device__ __forceinline__ State warp_reduce(State s, float inv_t) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) s = ts::merge(s, shfl_xor(s, offset), inv_t);
  return s;
}

__device__ __forceinline__ void write_outputs(std::int64_t row, const State& st, float inv_t,
                                              std::int64_t* __restrict__ token, float* __restrict__ prob,
                                              float* __restrict__ margin, float* __restrict__ entropy,
                                              float* __restrict__ lse) {
  const ts::Result r = ts::finalize(st, inv_t);
  token[row] = r.token;
  prob[row] = r.prob;
  margin[row] = r.margin;
  entropy[row] = r.entropy;
  lse[row] = r.lse;
}

template <int DT, int THREADS, int UNROLL>
__global__ void __launch_bounds__(THREADS)
    token_stats_kernel(const void* __restrict__ logits, std::int64_t row_stride, std::int64_t vocab,
                       std::int64_t cols_per_split, int num_splits, float inv_t, float* __restrict__ part_f,
                       int* __restrict__ part_i, std::int64_t* __restrict__ token, float* __restrict__ prob,
                       float* __restrict__ margin, float* __restrict__ entropy, float* __restrict__ lse) {
  constexpr int kWarps = THREADS / 32;
  static_assert(THREADS % 32 == 0 && kWarps <= 32, "THREADS must be a multiple of 32, at most 1024");

  const std::int64_t block = blockIdx.x;
  const std::int64_t row = block / num_splits;
  const std::int64_t split = block - row * num_splits;
  const int tid = threadIdx.x;
  std::int64_t lo, hi;
  split_range(vocab, cols_per_split, split, lo, hi);
  State st = thread_scan<DT, THREADS, UNROLL>(static_cast<const dt::elem_t<DT>*>(logits) + row * row_stride, lo, hi,
                                              tid, inv_t);

  st = warp_reduce(st, inv_t);
  __shared__ State smem[kWarps];
  const int warp = tid / 32, lane = tid % 32;
  if (lane == 0) smem[warp] = st;
  __syncthreads();
  if (warp != 0) return;
  st = lane < kWarps ? smem[lane] : ts::identity();
  st = warp_reduce(st, inv_t);
  if (lane != 0) return;

  if (num_splits == 1) {
    write_outputs(row, st, inv_t, token, prob, margin, entropy, lse);
  } else {
    const std::int64_t slot = block;  // == row * num_splits + split
    part_f[slot * 4 + 0] = st.m1;
    part_f[slot * 4 + 1] = st.m2;
    part_f[slot * 4 + 2] = st.s;
    part_f[slot * 4 + 3] = st.a;
    part_i[slot * 2 + 0] = st.i1;
    part_i[slot * 2 + 1] = st.nan;
  }
}

// One warp per row: merges the num_splits partial states of the row and writes the outputs.
template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    token_stats_merge_kernel(const float* __restrict__ part_f, const int* __restrict__ part_i, std::int64_t rows,
                             int num_splits, float inv_t, std::int64_t* __restrict__ token, float* __restrict__ prob,
                             float* __restrict__ margin, float* __restrict__ entropy, float* __restrict__ lse) {
  const int lane = threadIdx.x % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * WARPS + threadIdx.x / 32;
  if (row >= rows) return;  // whole warps leave together
  State st = ts::identity();
  for (int s = lane; s < num_splits; s += 32) {
    const std::int64_t slot = row * num_splits + s;
    State o;
    o.m1 = part_f[slot * 4 + 0];
    o.m2 = part_f[slot * 4 + 1];
    o.s = part_f[slot * 4 + 2];
    o.a = part_f[slot * 4 + 3];
    o.i1 = part_i[slot * 2 + 0];
    o.nan = part_i[slot * 2 + 1];
    st = ts::merge(st, o, inv_t);
  }
  st = warp_reduce(st, inv_t);
  if (lane == 0) write_outputs(row, st, inv_t, token, prob, margin, entropy, lse);
}

constexpr int kMergeWarps = 4;

template <int DT>
void launch(const TokenStatsArgs& a, cudaStream_t stream) {
  constexpr int kThreads = kTokenStatsThreads;
  // 32 bytes in flight per thread and step for 16-bit logits, 64 for fp32 (4 x uint4).
  constexpr int kUnroll = DT == kFloat32 ? 4 : 2;
  static_assert(kTokenStatsTile == kThreads * 8, "tile = threads x 8 elements");
  const std::int64_t cols_per_split = cols_per_split_for(a.vocab, a.num_splits);
  const int num_splits = static_cast<int>(a.num_splits);
  float* part_f = nullptr;
  int* part_i = nullptr;
  if (num_splits > 1) {
    part_f = static_cast<float*>(a.workspace);
    part_i = reinterpret_cast<int*>(part_f + a.rows * a.num_splits * 4);
  }
  const unsigned grid = static_cast<unsigned>(a.rows * a.num_splits);
  const auto kernel = &token_stats_kernel<DT, kThreads, kUnroll>;  // one macro argument
  DSPEC_LAUNCH(kernel, grid, kThreads, stream, a.logits, a.row_stride, a.vocab, cols_per_split, num_splits, a.inv_t,
               part_f, part_i, a.token, a.prob, a.margin, a.entropy, a.lse);
  if (num_splits > 1) {
    check_launch("token_stats");
    const unsigned merge_grid = static_cast<unsigned>((a.rows + kMergeWarps - 1) / kMergeWarps);
    DSPEC_LAUNCH(token_stats_merge_kernel<kMergeWarps>, merge_grid, kMergeWarps * 32, stream, part_f, part_i, a.rows,
                 num_splits, a.inv_t, a.token, a.prob, a.margin, a.entropy, a.lse);
  }
}

}  // namespace

void token_stats_cuda(const TokenStatsArgs& args, std::int64_t stream_handle) {
  if (args.rows <= 0) return;
  const cudaStream_t stream = as_stream(stream_handle);
  switch (args.dtype) {
    case kFloat32: launch<kFloat32>(args, stream); break;
    case kFloat16: launch<kFloat16>(args, stream); break;
    case kBFloat16: launch<kBFloat16>(args, stream); break;
    default: throw std::invalid_argument("dspec._C.token_stats: unknown dtype code");
  }
  check_launch("token_stats");
}

}  // namespace dspec
