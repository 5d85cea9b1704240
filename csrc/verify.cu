// verify_chain / verify_tree CUDA kernels (the design of dspec/kernels/verify.py).
//
// Four launches on one stream, no host synchronisation, no allocation (CUDA-graph safe):
//   1. token_stats_cuda over every target row [B * P, V] (argmax, 1 / S), into the workspace.
//   2. accept, one warp per row (grid.x = ceil(B / kVerifyAcceptWarps)):
//      chain: lane i decides position c0 + i (dspec::vf::chain_accepts), __ballot_sync finds
//      the first failure, 32 positions at a time;
//      tree: lane k precomputes node c0 + k (dspec::vf::tree_node: parent, token, coin, p of
//      the token under its parent's distribution: all independent of the walk), then every
//      lane runs the same scalar walk (dspec::vf::tree_step) over the 32 nodes, taking node
//      values by __shfl_sync, so the walk's state stays uniform across the warp.  The
//      excluded tokens of the current node live in the workspace's spec row (lane 0 writes,
//      __syncwarp, every lane reads).
//      Both write num_accepted, the tokens (and path) and, when sampling, the draw spec.
//      chain, block rule (rule="block", sampling): chain_block_sums_kernel first writes R_j
//      per (row, position) when there are draft_probs (grid.x = B * L), then
//      chain_block_accept_kernel (one warp per row) runs dspec::vf::chain_block_walk and
//      writes the spec with the residual scale w_tau.
//   3. draw tiles (grid.x = B * splits): per-tile sums of the draw weights w and of p.  A
//      tile is kVerifyDrawThreads x (one 16-byte load of logits) columns; thread t owns
//      columns tile_start + t * vec ... + vec - 1 (16-byte vector load when the row is
//      16-byte aligned and the group is whole, scalar loads otherwise).
//   4. draw pick (grid.x = B): block scans over the tile sums find the first tile whose
//      running sum passes u * total (else the last tile with a nonzero sum), then a block
//      scan over that tile finds the first token whose running sum passes (else the
//      tile's last token with w > 0).  The residual falls back to p when its total is 0;
//      token -1 when the total is not finite or not positive.
// All float math is float32 with accurate expf (no fast-math); element math is shared with
// the CPU code through dspec::vf (verify.h).
//
// DSPEC_CUDA_SIM: tests/cuda_sim compiles this file as plain C++ with a host simulator of
// blocks, warps, shuffles and barriers (tests/cuda_sim/cuda_sim.h) to run these kernels,
// launchers included, without a GPU.  Kernels are launched through DSPEC_LAUNCH
// (cuda_launch.h) for that.
#include "cuda_launch.h"

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dspec.h"
#include "dtype.h"
#include "verify.h"

namespace dspec {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kDrawWarps = kVerifyDrawThreads / 32;
constexpr int kExclShared = 64;  // excluded tokens cached in shared memory per draw block
static_assert(kVerifyDrawThreads % 32 == 0 && kDrawWarps <= 32, "draw block: whole warps, at most 1024 threads");

// ---- accept ---------------------------------------------------------------------------------

__global__ void __launch_bounds__(kVerifyAcceptWarps * 32)
    chain_accept_kernel(const VerifyChainArgs a, const VerifyWork w) {
  const int lane = threadIdx.x & 31;
  const std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * kVerifyAcceptWarps + (threadIdx.x >> 5);
  if (b >= a.batch) return;  // whole warps leave together
  const std::int64_t positions = a.positions, length = positions - 1;
  const std::int64_t n = vf::chain_num_drafts(a, b);
  std::int64_t j = n;  // position n always fails (no draft there)
  for (std::int64_t c0 = 0; c0 < n; c0 += 32) {
    const std::int64_t i = c0 + lane;
    bool fail = true;
    if (i < n) {
      fail = !vf::chain_accepts(a, w.argmax, w.prob, b, i, vf::load_id(a.drafts, a.draft_dtype, b * length + i));
    }
    const unsigned failing = __ballot_sync(kFull, fail);
    if (failing != 0u) {  // uniform
      j = c0 + __ffs(failing) - 1;
      break;
    }
  }
  const std::int64_t final_token = a.greedy ? w.argmax[b * positions + j] : std::int64_t(-1);
  for (std::int64_t i = lane; i < positions; i += 32) {
    std::int64_t v = -1;
    if (i < j) {
      v = vf::load_id(a.drafts, a.draft_dtype, b * length + i);
    } else if (i == j) {
      v = final_token;  // sampling: the draw pick writes it
    }
    a.tokens[b * positions + i] = v;
  }
  if (lane == 0) {
    a.num_accepted[b] = j;
    if (!a.greedy) {
      const bool rejected = j < n;
      const int mode = rejected ? (a.q != nullptr ? kModeResidualQ : kModeExclude) : kModeP;
      w.spec_row[b] = b * positions + j;
      w.spec_qrow[b] = b * a.q_stride_b + j * a.q_stride_l;
      w.spec_pos[b] = b * positions + j;
      w.spec_mode[b] = mode;
      w.spec_nex[b] = mode == kModeExclude ? 1 : 0;
      w.spec_excl[b] = rejected ? vf::load_id(a.drafts, a.draft_dtype, b * length + j) : std::int64_t(-1);
    }
  }
}

// Block rule (chain): R_j read from the workspace (chain_block_sums_kernel wrote it); the
// target rows are all scanned up front (stage 1), so there is nothing to ensure.
struct BlockNoEnsure {
  DSPEC_HD void operator()(std::int64_t) const {}
};
struct BlockReadR {
  const float* r;  // row b's R_j, j = 0 .. L - 1
  DSPEC_HD float operator()(std::int64_t j, float) const { return r[j]; }
};

// One warp per row: every lane runs the same scalar walk (dspec::vf::chain_block_walk, so
// the state stays uniform), then the lanes write the tokens and lane 0 the draw spec.
__global__ void __launch_bounds__(kVerifyAcceptWarps * 32)
    chain_block_accept_kernel(const VerifyChainArgs a, const VerifyWork w) {
  const int lane = threadIdx.x & 31;
  const std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * kVerifyAcceptWarps + (threadIdx.x >> 5);
  if (b >= a.batch) return;  // whole warps leave together
  const std::int64_t positions = a.positions, length = positions - 1;
  BlockReadR read_r;
  read_r.r = w.block_r + b * length;
  const vf::ChainBlock r = vf::chain_block_walk(a, w.argmax, w.prob, b, BlockNoEnsure{}, read_r);
  const std::int64_t tau = r.tau;
  for (std::int64_t i = lane; i < positions; i += 32) {
    a.tokens[b * positions + i] = i < tau ? vf::load_id(a.drafts, a.draft_dtype, b * length + i) : std::int64_t(-1);
  }
  if (lane == 0) {
    a.num_accepted[b] = tau;
    const bool rejected = tau < r.n_eff;
    const int mode = rejected ? (a.q != nullptr ? kModeResidualQ : kModeExclude) : kModeP;
    w.spec_row[b] = b * positions + tau;
    w.spec_qrow[b] = b * a.q_stride_b + tau * a.q_stride_l;
    w.spec_pos[b] = b * positions + tau;
    w.spec_mode[b] = mode;
    w.spec_nex[b] = mode == kModeExclude ? 1 : 0;
    w.spec_excl[b] = rejected ? vf::load_id(a.drafts, a.draft_dtype, b * length + tau) : std::int64_t(-1);
    w.spec_scale[b] = r.w_tau;
  }
}

__global__ void __launch_bounds__(kVerifyAcceptWarps * 32)
    tree_walk_kernel(const VerifyTreeArgs a, const VerifyWork w) {
  const int lane = threadIdx.x & 31;
  const std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * kVerifyAcceptWarps + (threadIdx.x >> 5);
  if (b >= a.batch) return;
  const std::int64_t nodes = a.positions, base = b * nodes;
  std::int64_t* excl = w.spec_excl + b * w.excl_cap;  // sampling only (excl_cap = nodes)
  vf::TreeWalk s = vf::tree_walk_start();
  for (std::int64_t c0 = 1; c0 < nodes; c0 += 32) {
    const std::int64_t c = c0 + lane;
    vf::TreeNode mine;
    if (c < nodes) {
      mine = vf::tree_node(a, w.argmax, w.prob, b, c);
    } else {
      mine.parent = -1;
      mine.token = -1;
      mine.p = 0.0f;
      mine.coin = 1.0f;
      mine.match = false;
    }
    const int count = nodes - c0 < 32 ? static_cast<int>(nodes - c0) : 32;
    for (int k = 0; k < count; ++k) {
      vf::TreeNode nd;
      nd.parent = __shfl_sync(kFull, static_cast<long long>(mine.parent), k);
      if (nd.parent != s.node) continue;  // uniform: every lane holds the same walk state
      nd.token = __shfl_sync(kFull, static_cast<long long>(mine.token), k);
      nd.p = __shfl_sync(kFull, mine.p, k);
      nd.coin = __shfl_sync(kFull, mine.coin, k);
      nd.match = __shfl_sync(kFull, mine.match ? 1 : 0, k) != 0;
      const bool seen = !a.greedy && vf::tree_seen(excl, s.nex, nd.token);
      bool drop;
      const bool move = vf::tree_step(s, c0 + k, nd, a.greedy, seen, drop);
      if (drop) {  // uniform
        if (lane == 0) excl[s.nex - 1] = nd.token;
        __syncwarp();
      }
      if (move && lane == 0) {
        a.path[base + s.depth - 1] = c0 + k;
        a.out[base + s.depth - 1] = nd.token;
      }
    }
  }
  const std::int64_t depth = s.depth;  // <= nodes - 1
  const std::int64_t final_token = a.greedy ? w.argmax[base + s.node] : std::int64_t(-1);
  for (std::int64_t d = depth + lane; d < nodes; d += 32) {  // slots the walk did not write
    a.path[base + d] = -1;
    a.out[base + d] = d == depth ? final_token : std::int64_t(-1);
  }
  if (lane == 0) {
    a.num_accepted[b] = depth;
    if (!a.greedy) {
      w.spec_row[b] = base + s.node;
      w.spec_qrow[b] = 0;
      w.spec_pos[b] = base + depth;
      w.spec_mode[b] = s.nex > 0 ? kModeExclude : kModeP;
      w.spec_nex[b] = s.nex;
    }
  }
}

// With draft probabilities (sampling): the walk of tree_walk_kernel with dspec::vf::tree_q_*
// (every lane holds the same walk state).  A rejection runs the residual pass over the
// vocabulary: lane l updates columns l, l + 32, ... of row b's residual (the workspace's
// resid row), the two sums reduced by xor shuffles (every lane ends with the same bits);
// __syncwarp before the pass (no lane overwrites r(x) before every lane has read it for the
// accept test) and after it (before any lane reads a column another lane wrote).  Without replacement
// the removed tokens are the spec row's excluded tokens (lane 0 writes, __syncwarp).
__global__ void __launch_bounds__(kVerifyAcceptWarps * 32)
    tree_walk_q_kernel(const VerifyTreeArgs a, const VerifyWork w) {
  const int lane = threadIdx.x & 31;
  const std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * kVerifyAcceptWarps + (threadIdx.x >> 5);
  if (b >= a.batch) return;
  const std::int64_t nodes = a.positions, base = b * nodes, vocab = a.vocab;
  std::int64_t* excl = w.spec_excl + b * w.excl_cap;
  float* resid = w.resid + b * vocab;
  const std::int64_t q_size = a.q_dtype == kFloat32 ? 4 : 2;
  vf::TreeWalk s = vf::tree_walk_start();
  for (std::int64_t c0 = 1; c0 < nodes; c0 += 32) {
    const std::int64_t c = c0 + lane;
    vf::TreeNode mine;
    if (c < nodes) {
      mine = vf::tree_node(a, w.argmax, w.prob, b, c);
    } else {
      mine.parent = -1;
      mine.token = -1;
      mine.p = 0.0f;
      mine.coin = 1.0f;
      mine.match = false;
      mine.q = 0.0f;
    }
    const int count = nodes - c0 < 32 ? static_cast<int>(nodes - c0) : 32;
    for (int k = 0; k < count; ++k) {
      vf::TreeNode nd;
      nd.parent = __shfl_sync(kFull, static_cast<long long>(mine.parent), k);
      if (nd.parent != s.node) continue;  // uniform
      nd.token = __shfl_sync(kFull, static_cast<long long>(mine.token), k);
      nd.p = __shfl_sync(kFull, mine.p, k);
      nd.coin = __shfl_sync(kFull, mine.coin, k);
      nd.q = __shfl_sync(kFull, mine.q, k);
      nd.match = false;
      const bool removed = a.without_replacement && vf::tree_seen(excl, s.nex, nd.token);
      const bool in_vocab = nd.token >= 0 && nd.token < vocab;
      const float r_x = s.has_resid && in_vocab ? resid[nd.token] : nd.p;
      const int step = vf::tree_q_decide(s, nd, removed, r_x);
      if (step == vf::kTreeQMove) {  // uniform
        vf::tree_q_move(s, c0 + k);
        if (lane == 0) {
          a.path[base + s.depth - 1] = c0 + k;
          a.out[base + s.depth - 1] = nd.token;
        }
      } else if (step == vf::kTreeQReject) {  // uniform
        __syncwarp();                         // every lane has read r(x) and the removed tokens before the pass writes
        const std::int64_t row = base + s.node;
        const vf::RowDist d = vf::row_dist(a, w.argmax, w.prob, row);
        const char* q_row = static_cast<const char*>(a.q) + (b * a.q_stride_b + s.node * a.q_stride_n) * q_size;
        float sum_r = 0.0f, sum_kept = 0.0f;
        for (std::int64_t col = lane; col < vocab; col += 32) {
          const bool gone = a.without_replacement && vf::tree_seen(excl, s.nex, col);
          const float q_v = dt::load(q_row, a.q_dtype, col);
          const float r_v = s.has_resid
                                ? resid[col]
                                : vf::target_p(dt::load(a.logits, a.dtype, row * a.row_stride + col), d, a.inv_t);
          const float r_new = vf::tree_q_residual(s, r_v, q_v, gone);
          resid[col] = r_new;
          sum_r += r_new;
          if (!gone && col != nd.token) sum_kept += q_v;
        }
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) {
          sum_r += __shfl_xor_sync(kFull, sum_r, off);
          sum_kept += __shfl_xor_sync(kFull, sum_kept, off);
        }
        __syncwarp();
        vf::tree_q_rejected(s, sum_r, sum_kept, a.without_replacement);
        if (a.without_replacement) {
          if (lane == 0) excl[s.nex - 1] = nd.token;
          __syncwarp();
        }
      }
    }
  }
  const std::int64_t depth = s.depth;
  for (std::int64_t d = depth + lane; d < nodes; d += 32) {  // slots the walk did not write
    a.path[base + d] = -1;
    a.out[base + d] = -1;  // the draw pick writes slot depth
  }
  if (lane == 0) {
    a.num_accepted[b] = depth;
    w.spec_row[b] = base + s.node;
    w.spec_qrow[b] = 0;
    w.spec_pos[b] = base + depth;
    w.spec_mode[b] = s.has_resid ? kModeResid : kModeP;
    w.spec_nex[b] = 0;
  }
}

// ---- block primitives (kVerifyDrawThreads threads; each ends with __syncthreads) --------

__device__ __forceinline__ void block_sum2(float& x, float& y, float (*smem)[kDrawWarps]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    x += __shfl_xor_sync(kFull, x, off);
    y += __shfl_xor_sync(kFull, y, off);
  }
  if (lane == 0) {
    smem[0][warp] = x;
    smem[1][warp] = y;
  }
  __syncthreads();
  x = lane < kDrawWarps ? smem[0][lane] : 0.0f;
  y = lane < kDrawWarps ? smem[1][lane] : 0.0f;
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    x += __shfl_xor_sync(kFull, x, off);
    y += __shfl_xor_sync(kFull, y, off);
  }
  __syncthreads();
}

template <bool kMin>
__device__ __forceinline__ int block_extreme(int v, int* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    const int o = __shfl_xor_sync(kFull, v, off);
    v = kMin ? min(v, o) : max(v, o);
  }
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < kDrawWarps ? smem[lane] : (kMin ? INT_MAX : INT_MIN);
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) {
    const int o = __shfl_xor_sync(kFull, v, off);
    v = kMin ? min(v, o) : max(v, o);
  }
  __syncthreads();
  return v;
}

__device__ __forceinline__ float warp_inclusive_scan(float v, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float o = __shfl_up_sync(kFull, v, off);
    if (lane >= off) v += o;
  }
  return v;
}

// Exclusive prefix sum over the block in thread order; `total` gets the block's sum.
__device__ __forceinline__ float block_exclusive_scan(float v, float& total, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float incl = warp_inclusive_scan(v, lane);
  float before_in_warp = __shfl_up_sync(kFull, incl, 1);
  if (lane == 0) before_in_warp = 0.0f;
  if (lane == 31) smem[warp] = incl;
  __syncthreads();
  const float warp_incl = warp_inclusive_scan(lane < kDrawWarps ? smem[lane] : 0.0f, lane);
  float warp_before = __shfl_sync(kFull, warp_incl, warp > 0 ? warp - 1 : 0);
  if (warp == 0) warp_before = 0.0f;
  total = __shfl_sync(kFull, warp_incl, kDrawWarps - 1);
  __syncthreads();
  return warp_before + before_in_warp;
}

// ---- block rule sums ----------------------------------------------------------------------

// grid.x = B * L: block (b, j), 1 <= j < num_drafts[b], writes the block rule's R_j = sum_v
// max(w_j p_j(v) - q_j(v), 0) (draft_probs given; float32 tree sum), w_j recomputed from the
// drafts before j (dspec::vf::chain_block_w, the walk's own float32 steps).
__global__ void __launch_bounds__(kVerifyDrawThreads)
    chain_block_sums_kernel(const VerifyChainArgs a, const VerifyWork w) {
  __shared__ float s_red[2][kDrawWarps];
  const std::int64_t length = a.positions - 1;
  const std::int64_t b = blockIdx.x / length, j = blockIdx.x - b * length;
  if (j < 1 || j >= vf::chain_num_drafts(a, b)) return;  // uniform
  const float wj = vf::chain_block_w(a, w.argmax, w.prob, b, j);
  const std::int64_t row = b * a.positions + j;
  const vf::RowDist d = vf::row_dist(a, w.argmax, w.prob, row);
  const char* q_row =
      static_cast<const char*>(a.q) + (b * a.q_stride_b + j * a.q_stride_l) * (a.q_dtype == kFloat32 ? 4 : 2);
  float sum = 0.0f, unused = 0.0f;
  for (std::int64_t col = threadIdx.x; col < a.vocab; col += kVerifyDrawThreads) {
    const float p = vf::target_p(dt::load(a.logits, a.dtype, row * a.row_stride + col), d, a.inv_t);
    sum += vf::residual(vf::mul_rn(wj, p), dt::load(q_row, a.q_dtype, col));
  }
  block_sum2(sum, unused, s_red);
  if (threadIdx.x == 0) w.block_r[b * length + j] = sum;
}

// ---- draw -------------------------------------------------------------------------------

// Logits of columns col0 .. col0 + VEC - 1 (VEC * sizeof(T) = 16 bytes); -inf past the row.
template <int DT, int VEC>
__device__ __forceinline__ void load_group(const char* row_ptr, std::int64_t col0, std::int64_t vocab, bool aligned,
                                           float (&l)[VEC]) {
  using T = dt::elem_t<DT>;
  static_assert(VEC * sizeof(T) == 16, "one 16-byte vector per thread");
  if (aligned && col0 + VEC <= vocab) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row_ptr + col0 * static_cast<std::int64_t>(sizeof(T))));
    const unsigned u[4] = {raw.x, raw.y, raw.z, raw.w};
    if constexpr (DT == kFloat32) {
#pragma unroll
      for (int k = 0; k < 4; ++k) l[k] = __uint_as_float(u[k]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const auto lo = static_cast<std::uint16_t>(u[k] & 0xffffu), hi = static_cast<std::uint16_t>(u[k] >> 16);
        l[2 * k] = dt::to_float<DT>(lo);
        l[2 * k + 1] = dt::to_float<DT>(hi);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) l[k] = col0 + k < vocab ? dt::load<DT>(row_ptr, col0 + k) : -INFINITY;
  }
}

// What a draw block knows about its row's spec.
struct DrawRow {
  const char* row_ptr;  // logits row
  bool aligned;         // row_ptr 16-byte aligned
  vf::RowDist d;
  int mode;
  int nex;
  const std::int64_t* excl;  // nex excluded tokens (the first kExclShared also in shared memory)
  const void* q_row;         // mode 2: the draft_probs row, else null
  int q_dtype;
  float scale;             // mode 2: w = max(scale * p - q, 0) (the block rule's w_tau; else 1)
  const float* resid_row;  // mode 3: the tree walk's residual row (the weights), else null
};

template <int DT>
__device__ __forceinline__ DrawRow draw_row(const VerifyCommon& a, const void* q, int q_dtype, const VerifyWork& w,
                                            std::int64_t b, std::int64_t* s_excl) {
  using T = dt::elem_t<DT>;
  DrawRow r;
  const std::int64_t row = w.spec_row[b];
  r.row_ptr = static_cast<const char*>(a.logits) + row * a.row_stride * static_cast<std::int64_t>(sizeof(T));
  r.aligned = (reinterpret_cast<std::uintptr_t>(r.row_ptr) & 15u) == 0;
  r.d = vf::row_dist(a, w.argmax, w.prob, row);
  r.mode = w.spec_mode[b];
  r.nex = w.spec_nex[b];
  r.excl = w.spec_excl + b * w.excl_cap;
  r.q_dtype = q_dtype;
  r.q_row = (r.mode == kModeResidualQ && q != nullptr)
                ? static_cast<const char*>(q) + w.spec_qrow[b] * (q_dtype == kFloat32 ? 4 : 2)
                : nullptr;
  r.scale = (w.spec_scale != nullptr && r.mode == kModeResidualQ) ? w.spec_scale[b] : 1.0f;
  r.resid_row = r.mode == kModeResid ? w.resid + b * a.vocab : nullptr;
  for (int k = threadIdx.x; k < r.nex && k < kExclShared; k += blockDim.x) s_excl[k] = r.excl[k];
  __syncthreads();
  return r;
}

// This thread's VEC columns from col0: draw weights w and p (0 past the row).
template <int DT, int VEC>
__device__ __forceinline__ void group_weights(const DrawRow& r, const std::int64_t* s_excl, std::int64_t col0,
                                              std::int64_t vocab, float inv_t, float (&wv)[VEC], float (&pv)[VEC]) {
  float l[VEC];
  load_group<DT, VEC>(r.row_ptr, col0, vocab, r.aligned, l);
  unsigned excluded = 0u;
  for (int k = 0; k < r.nex; ++k) {
    const std::int64_t off = (k < kExclShared ? s_excl[k] : r.excl[k]) - col0;
    if (off >= 0 && off < VEC) excluded |= 1u << off;
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const std::int64_t col = col0 + k;
    const bool in_row = col < vocab;
    const float q = (r.q_row != nullptr && in_row) ? dt::load(r.q_row, r.q_dtype, col) : 0.0f;
    float wk, pk;
    vf::draw_weights(l[k], q, ((excluded >> k) & 1u) != 0u, r.mode, r.d, inv_t, wk, pk, r.scale);
    if (r.resid_row != nullptr) wk = in_row ? r.resid_row[col] : 0.0f;
    wv[k] = in_row ? wk : 0.0f;
    pv[k] = in_row ? pk : 0.0f;
  }
}

// grid.x = B * splits: block (b, split) writes the sums of w and p of its tiles of row b.
template <int DT>
__global__ void __launch_bounds__(kVerifyDrawThreads)
    draw_tiles_kernel(const VerifyCommon a, const void* q, int q_dtype, const VerifyWork w, int splits,
                      std::int64_t tiles_per_split) {
  constexpr int VEC = 16 / sizeof(dt::elem_t<DT>);
  constexpr std::int64_t TILE = std::int64_t(kVerifyDrawThreads) * VEC;
  __shared__ std::int64_t s_excl[kExclShared];
  __shared__ float s_red[2][kDrawWarps];
  const std::int64_t b = blockIdx.x / splits;
  const std::int64_t split = blockIdx.x - b * splits;
  const DrawRow r = draw_row<DT>(a, q, q_dtype, w, b, s_excl);
  const std::int64_t num_tiles = w.num_tiles;
  const std::int64_t t0 = split * tiles_per_split;
  const std::int64_t t1 = t0 + tiles_per_split < num_tiles ? t0 + tiles_per_split : num_tiles;
  for (std::int64_t tile = t0; tile < t1; ++tile) {
    float wv[VEC], pv[VEC];
    group_weights<DT, VEC>(r, s_excl, tile * TILE + threadIdx.x * VEC, a.vocab, a.inv_t, wv, pv);
    float sw = 0.0f, sp = 0.0f;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      sw += wv[k];
      sp += pv[k];
    }
    block_sum2(sw, sp, s_red);
    if (threadIdx.x == 0) {
      w.tile_w[b * num_tiles + tile] = sw;
      w.tile_p[b * num_tiles + tile] = sp;
    }
  }
}

// grid.x = B: block b finds the tile, then the token, and writes it to out[spec_pos[b]].
template <int DT>
__global__ void __launch_bounds__(kVerifyDrawThreads)
    draw_pick_kernel(const VerifyCommon a, const void* q, int q_dtype, const VerifyWork w, std::int64_t* out) {
  constexpr int VEC = 16 / sizeof(dt::elem_t<DT>);
  constexpr std::int64_t TILE = std::int64_t(kVerifyDrawThreads) * VEC;
  __shared__ std::int64_t s_excl[kExclShared];
  __shared__ float s_red[2][kDrawWarps];
  __shared__ float s_scan[kDrawWarps];
  __shared__ int s_int[kDrawWarps];
  __shared__ float s_before, s_before_last;
  const int tid = threadIdx.x;
  const std::int64_t b = blockIdx.x;
  const std::int64_t pos = w.spec_pos[b];
  const DrawRow r = draw_row<DT>(a, q, q_dtype, w, b, s_excl);
  const int num_tiles = static_cast<int>(w.num_tiles);  // vocab < 2^31
  const float* tw = w.tile_w + b * w.num_tiles;
  const float* tp = w.tile_p + b * w.num_tiles;

  // totals; the residual is replaced by p when it is empty (0, not NaN)
  float sw = 0.0f, sp = 0.0f;
  int last_w = -1, last_p = -1;
  for (int k = tid; k < num_tiles; k += kVerifyDrawThreads) {
    const float x = tw[k], y = tp[k];
    sw += x;
    sp += y;
    if (x > 0.0f) last_w = k;
    if (y > 0.0f) last_p = k;
  }
  block_sum2(sw, sp, s_red);
  const bool use_p = vf::draw_use_p(sw);
  const float total = use_p ? sp : sw;
  if (!(total > 0.0f && total < INFINITY)) {  // uniform
    if (tid == 0) out[pos] = -1;
    return;
  }
  const int last_nonzero = block_extreme<false>(use_p ? last_p : last_w, s_int);
  const float target = a.uniforms[b] * total;
  const float* ts = use_p ? tp : tw;

  // the first tile whose running sum passes the target
  int tile = -1;
  float before = 0.0f, carry = 0.0f;
  for (int c0 = 0; c0 < num_tiles; c0 += kVerifyDrawThreads) {
    const int k = c0 + tid;
    const float v = k < num_tiles ? ts[k] : 0.0f;
    float chunk_total;
    const float ex = block_exclusive_scan(v, chunk_total, s_scan);
    if (k == last_nonzero) s_before_last = carry + ex;
    const bool hit = k < num_tiles && carry + (ex + v) > target;
    const int first = block_extreme<true>(hit ? k : INT_MAX, s_int);
    if (first != INT_MAX) {  // uniform
      if (k == first) s_before = carry + ex;
      __syncthreads();
      tile = first;
      before = s_before;
      break;
    }
    carry = carry + chunk_total;
  }
  __syncthreads();
  if (tile < 0) {  // rounding left no tile past the target: the last nonzero one
    tile = last_nonzero;
    before = s_before_last;
  }
  if (tile < 0) {  // cannot happen with total > 0; kept for safety
    if (tid == 0) out[pos] = -1;
    return;
  }

  // the token inside the tile
  const std::int64_t col0 = tile * TILE + static_cast<std::int64_t>(tid) * VEC;
  float wv[VEC], pv[VEC];
  group_weights<DT, VEC>(r, s_excl, col0, a.vocab, a.inv_t, wv, pv);
  float run[VEC];
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    wv[k] = use_p ? pv[k] : wv[k];
    acc += wv[k];
    run[k] = acc;
  }
  float tile_total;
  const float ex = block_exclusive_scan(acc, tile_total, s_scan);
  int hit = INT_MAX, last = -1;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const std::int64_t col = col0 + k;
    if (col < a.vocab) {
      if (hit == INT_MAX && before + (ex + run[k]) > target) hit = static_cast<int>(col);
      if (wv[k] > 0.0f) last = static_cast<int>(col);
    }
  }
  hit = block_extreme<true>(hit, s_int);
  last = block_extreme<false>(last, s_int);
  if (tid == 0) out[pos] = hit != INT_MAX ? hit : (last >= 0 ? last : -1);
}

template <int DT>
void draw(const VerifyCommon& a, const void* q, int q_dtype, const VerifyWork& w, std::int64_t* out,
          cudaStream_t stream, const char* op) {
  const std::int64_t tiles = w.num_tiles;
  const std::int64_t want = a.draw_splits < tiles ? a.draw_splits : tiles;
  const std::int64_t tiles_per_split = (tiles + want - 1) / want;
  const std::int64_t splits = (tiles + tiles_per_split - 1) / tiles_per_split;
  DSPEC_LAUNCH(draw_tiles_kernel<DT>, static_cast<unsigned>(a.batch * splits), kVerifyDrawThreads, stream, a, q,
               q_dtype, w, static_cast<int>(splits), tiles_per_split);
  check_launch(op, "draw_tiles_kernel");
  DSPEC_LAUNCH(draw_pick_kernel<DT>, static_cast<unsigned>(a.batch), kVerifyDrawThreads, stream, a, q, q_dtype, w, out);
  check_launch(op, "draw_pick_kernel");
}

void draw_any(const VerifyCommon& a, const void* q, int q_dtype, const VerifyWork& w, std::int64_t* out,
              cudaStream_t stream, const char* op) {
  switch (a.dtype) {
    case kFloat32: draw<kFloat32>(a, q, q_dtype, w, out, stream, op); break;
    case kFloat16: draw<kFloat16>(a, q, q_dtype, w, out, stream, op); break;
    case kBFloat16: draw<kBFloat16>(a, q, q_dtype, w, out, stream, op); break;
    default: throw std::invalid_argument(std::string("dspec._C.") + op + ": unknown dtype code");
  }
}

unsigned accept_grid(std::int64_t batch) {
  return static_cast<unsigned>((batch + kVerifyAcceptWarps - 1) / kVerifyAcceptWarps);
}

}  // namespace

void verify_chain_cuda(const VerifyChainArgs& a, std::int64_t stream_handle) {
  if (a.batch <= 0) return;
  const cudaStream_t stream = as_stream(stream_handle);
  const bool block = a.block && !a.greedy;
  const VerifyLayout l = verify_layout(a.batch, a.positions, a.vocab, a.dtype, 1, !a.greedy, a.ts_splits, block);
  const VerifyWork w = verify_work(a.workspace, l);
  token_stats_cuda(verify_token_stats_args(a, w), stream_handle);
  if (block) {
    const std::int64_t length = a.positions - 1;
    if (a.q != nullptr && length > 1) {
      DSPEC_LAUNCH(chain_block_sums_kernel, static_cast<unsigned>(a.batch * length), kVerifyDrawThreads, stream, a, w);
      check_launch("verify_chain", "chain_block_sums_kernel");
    }
    DSPEC_LAUNCH(chain_block_accept_kernel, accept_grid(a.batch), kVerifyAcceptWarps * 32, stream, a, w);
    check_launch("verify_chain", "chain_block_accept_kernel");
  } else {
    DSPEC_LAUNCH(chain_accept_kernel, accept_grid(a.batch), kVerifyAcceptWarps * 32, stream, a, w);
    check_launch("verify_chain", "chain_accept_kernel");
  }
  if (!a.greedy) draw_any(a, a.q, a.q_dtype, w, a.tokens, stream, "verify_chain");
}

void verify_tree_cuda(const VerifyTreeArgs& a, std::int64_t stream_handle) {
  if (a.batch <= 0) return;
  const cudaStream_t stream = as_stream(stream_handle);
  const bool with_q = !a.greedy && a.q != nullptr;
  const VerifyLayout l = verify_layout(a.batch, a.positions, a.vocab, a.dtype, a.positions, !a.greedy, a.ts_splits,
                                       false, with_q ? a.batch : 0);
  const VerifyWork w = verify_work(a.workspace, l);
  token_stats_cuda(verify_token_stats_args(a, w), stream_handle);
  if (with_q) {
    DSPEC_LAUNCH(tree_walk_q_kernel, accept_grid(a.batch), kVerifyAcceptWarps * 32, stream, a, w);
    check_launch("verify_tree", "tree_walk_q_kernel");
  } else {
    DSPEC_LAUNCH(tree_walk_kernel, accept_grid(a.batch), kVerifyAcceptWarps * 32, stream, a, w);
    check_launch("verify_tree", "tree_walk_kernel");
  }
  if (!a.greedy) draw_any(a, nullptr, kFloat32, w, a.out, stream, "verify_tree");
}

}  // namespace dspec
