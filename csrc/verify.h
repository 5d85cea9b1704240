// dspec._C verify_chain / verify_tree: declarations, workspace layout and the per-row /
// per-element math shared by the C++ CPU code (verify_cpu.cpp) and the CUDA kernels
// (verify.cu).  Plain C++17 like dspec.h (no pybind11; cuda_fp16.h only under nvcc).
//
// The design mirrors dspec/kernels/verify.py (the Triton kernels):
//   1. token_stats (dspec.h) over every target row [B * P, V] (P = L + 1 or N): argmax
//      (-1 for an invalid row) and prob = 1 / S, so p(v) = exp((logit_v - logit_argmax) *
//      inv_t) * prob is one load away for any v.
//   2. accept: chain (every position: greedy x == argmax, sampling coin * q(x) < p(x); the
//      first failure j is the row's length) or tree (a scalar walk over the nodes in index
//      order).  Writes num_accepted, the accepted tokens (and the tree path) and, when
//      sampling, a draw spec: target row, q row offset, mode, excluded tokens, output slot.
//   3. draw: per-tile sums of the draw weights w (and of p, the fallback for an empty
//      residual), then a pick: the first tile whose running sum passes u * total, then the
//      first token inside it.
// Every function below is __host__ __device__ so the CPU code and the kernels evaluate
// literally the same float32 expressions for p, the residual, the acceptance tests and the
// tree walk.  (Sums differ: the kernels reduce in float32 trees as Triton does, the CPU code
// accumulates in double.)
#pragma once

#include <cmath>
#include <cstdint>

#include "dspec.h"
#include "dtype.h"

namespace dspec {

// Draw spec modes (as MODE_* in dspec/kernels/verify.py).
// kModeResid: the tree walk's residual r, materialised in the workspace's resid row.
enum DrawMode : int { kModeP = 0, kModeExclude = 1, kModeResidualQ = 2, kModeResid = 3 };

// CUDA geometry.  Accept kernels: one warp per row, kVerifyAcceptWarps rows per block.
// Draw kernels: kVerifyDrawThreads threads; thread t of a tile owns the draw_vec(dtype)
// consecutive columns tile_start + t * vec (one 16-byte load of logits), so a tile is
// kVerifyDrawThreads * 16 bytes of logits: 1024 float32 or 2048 float16 / bfloat16 columns.
// The CPU code uses the same tiles.
constexpr int kVerifyAcceptWarps = 4;
constexpr int kVerifyDrawThreads = 256;

DSPEC_HD int draw_vec(int dtype) { return dtype == kFloat32 ? 4 : 8; }
DSPEC_HD std::int64_t draw_tile(int dtype) { return std::int64_t(kVerifyDrawThreads) * draw_vec(dtype); }
DSPEC_HD std::int64_t draw_num_tiles(std::int64_t vocab, int dtype) {
  return (vocab + draw_tile(dtype) - 1) / draw_tile(dtype);
}

// Arguments common to both ops (all validated by bindings.cpp before any launch).
struct VerifyCommon {
  const void* logits = nullptr;  // rows = batch * positions rows of vocab, unit stride along vocab
  int dtype = kFloat32;
  std::int64_t batch = 0;
  std::int64_t positions = 0;  // chain: L + 1; tree: N
  std::int64_t vocab = 0;
  std::int64_t row_stride = 0;
  bool greedy = true;
  float inv_t = 1.0f;               // 1 / temperature (1 when greedy)
  const float* coins = nullptr;     // [B, L] (chain) / [B, N] (tree), contiguous; sampling only
  const float* uniforms = nullptr;  // [B]; sampling only
  std::int64_t ts_splits = 1;       // token_stats vocabulary splits (CUDA)
  std::int64_t draw_splits = 1;     // blocks per row of the draw tile sums (CUDA)
  void* workspace = nullptr;        // verify_layout(...).bytes bytes, 16-byte aligned
  int num_threads = 1;              // CPU: at most this many threads (the caller's count)
};

struct VerifyChainArgs : VerifyCommon {
  const void* drafts = nullptr;  // [B, L] contiguous, id dtype draft_dtype
  int draft_dtype = kInt64;
  const std::int64_t* num_drafts = nullptr;  // [B] or null (= L); values clamped to [0, L]
  const void* q = nullptr;                   // draft_probs or null (one-hot drafts)
  int q_dtype = kFloat32;
  std::int64_t q_stride_b = 0;  // elements; unit stride along vocab
  std::int64_t q_stride_l = 0;
  std::int64_t* num_accepted = nullptr;  // [B]
  std::int64_t* tokens = nullptr;        // [B, L + 1]
  bool block = false;                    // block verification (sampling only; see chain_block_walk)
};

struct VerifyTreeArgs : VerifyCommon {
  const void* tokens = nullptr;  // [B, N] contiguous
  int token_dtype = kInt64;
  const void* parents = nullptr;  // [B, N] contiguous
  int parent_dtype = kInt64;
  std::int64_t* num_accepted = nullptr;  // [B]
  std::int64_t* path = nullptr;          // [B, N]
  std::int64_t* out = nullptr;           // [B, N]
  // draft_probs q [B, N, V] (sampling only; null: one-hot drafts): q[b, u] is the drafter's
  // distribution u's children were drawn from, i.i.d. or without replacement.
  const void* q = nullptr;
  int q_dtype = kFloat32;
  std::int64_t q_stride_b = 0;  // elements; unit stride along vocab
  std::int64_t q_stride_n = 0;
  bool without_replacement = false;
};

// ---- workspace ------------------------------------------------------------------------
// Byte offsets of the workspace sections (each 256-byte aligned); section sizes are 0 where
// unused (greedy: no spec, no tiles).  excl_cap: excluded-token slots per row (1 for a
// chain, N for a tree).  Arguments assumed validated (no overflow: see bindings.cpp).
struct VerifyLayout {
  std::int64_t argmax, prob, margin, entropy, lse, ts_partial;
  std::int64_t spec_row, spec_qrow, spec_pos, spec_mode, spec_nex, spec_excl;
  std::int64_t tile_w, tile_p;
  std::int64_t num_tiles, excl_cap;
  std::int64_t resid;  // tree with draft_probs: [resid_rows, vocab] float32 residuals (CUDA)
  std::int64_t bytes;
  // chain, block rule (sampling): the draw's residual scale w_tau per row, and R_j per
  // (row, position) (CUDA: computed before the acceptance walk); unused sections are 0 bytes
  std::int64_t spec_scale, block_r;
  bool block;
};

inline VerifyLayout verify_layout(std::int64_t batch, std::int64_t positions, std::int64_t vocab, int dtype,
                                  std::int64_t excl_cap, bool sampling, std::int64_t ts_splits, bool block = false,
                                  std::int64_t resid_rows = 0) {
  VerifyLayout l{};
  const std::int64_t rows = batch * positions;
  std::int64_t at = 0;
  auto take = [&](std::int64_t bytes) {
    const std::int64_t off = at;
    at += (bytes + 255) / 256 * 256;
    return off;
  };
  l.argmax = take(rows * 8);
  l.prob = take(rows * 4);
  l.margin = take(rows * 4);
  l.entropy = take(rows * 4);
  l.lse = take(rows * 4);
  l.ts_partial = take(token_stats_workspace_bytes(rows, ts_splits));
  l.excl_cap = excl_cap;
  l.num_tiles = draw_num_tiles(vocab, dtype);
  const std::int64_t b = sampling ? batch : 0;
  l.spec_row = take(b * 8);
  l.spec_qrow = take(b * 8);
  l.spec_pos = take(b * 8);
  l.spec_mode = take(b * 4);
  l.spec_nex = take(b * 4);
  l.spec_excl = take(b * excl_cap * 8);
  l.tile_w = take(b * l.num_tiles * 4);
  l.tile_p = take(b * l.num_tiles * 4);
  l.block = block && sampling;
  l.spec_scale = take(l.block ? batch * 4 : 0);
  l.block_r = take(l.block ? batch * (positions - 1) * 4 : 0);
  l.resid = take(resid_rows * vocab * 4);
  l.bytes = at;
  return l;
}

// Typed views of a workspace.
struct VerifyWork {
  std::int64_t* argmax;
  float* prob;
  float* margin;
  float* entropy;
  float* lse;
  void* ts_partial;
  std::int64_t* spec_row;
  std::int64_t* spec_qrow;
  std::int64_t* spec_pos;
  std::int32_t* spec_mode;
  std::int32_t* spec_nex;
  std::int64_t* spec_excl;
  float* tile_w;
  float* tile_p;
  std::int64_t num_tiles;
  std::int64_t excl_cap;
  float* spec_scale;  // null unless the layout is the block rule's
  float* block_r;     // [B, L]; null unless the layout is the block rule's
  float* resid;
};

inline VerifyWork verify_work(void* workspace, const VerifyLayout& l) {
  char* base = static_cast<char*>(workspace);
  VerifyWork w;
  w.argmax = reinterpret_cast<std::int64_t*>(base + l.argmax);
  w.prob = reinterpret_cast<float*>(base + l.prob);
  w.margin = reinterpret_cast<float*>(base + l.margin);
  w.entropy = reinterpret_cast<float*>(base + l.entropy);
  w.lse = reinterpret_cast<float*>(base + l.lse);
  w.ts_partial = base + l.ts_partial;
  w.spec_row = reinterpret_cast<std::int64_t*>(base + l.spec_row);
  w.spec_qrow = reinterpret_cast<std::int64_t*>(base + l.spec_qrow);
  w.spec_pos = reinterpret_cast<std::int64_t*>(base + l.spec_pos);
  w.spec_mode = reinterpret_cast<std::int32_t*>(base + l.spec_mode);
  w.spec_nex = reinterpret_cast<std::int32_t*>(base + l.spec_nex);
  w.spec_excl = reinterpret_cast<std::int64_t*>(base + l.spec_excl);
  w.tile_w = reinterpret_cast<float*>(base + l.tile_w);
  w.tile_p = reinterpret_cast<float*>(base + l.tile_p);
  w.num_tiles = l.num_tiles;
  w.excl_cap = l.excl_cap;
  w.spec_scale = l.block ? reinterpret_cast<float*>(base + l.spec_scale) : nullptr;
  w.block_r = l.block ? reinterpret_cast<float*>(base + l.block_r) : nullptr;
  w.resid = reinterpret_cast<float*>(base + l.resid);
  return w;
}

// Stage-1 token_stats arguments over all target rows, writing into the workspace.
inline TokenStatsArgs verify_token_stats_args(const VerifyCommon& a, const VerifyWork& w) {
  TokenStatsArgs ts;
  ts.logits = a.logits;
  ts.dtype = a.dtype;
  ts.rows = a.batch * a.positions;
  ts.vocab = a.vocab;
  ts.row_stride = a.row_stride;
  ts.inv_t = a.inv_t;
  ts.token = w.argmax;
  ts.prob = w.prob;
  ts.margin = w.margin;
  ts.entropy = w.entropy;
  ts.lse = w.lse;
  ts.num_splits = a.ts_splits;
  ts.workspace = w.ts_partial;
  ts.argmax_only = a.greedy;  // greedy acceptance reads the argmax alone (CPU: no exp pass)
  ts.num_threads = a.num_threads;
  return ts;
}

// All assume validated arguments and batch >= 1.
void verify_chain_cpu(const VerifyChainArgs& args);
void verify_tree_cpu(const VerifyTreeArgs& args);
// Launch on `stream` (a cudaStream_t as an integer) on the current device; no host sync, no
// allocation.  Throw std::runtime_error when a launch fails.  Only with DSPEC_WITH_CUDA.
void verify_chain_cuda(const VerifyChainArgs& args, std::int64_t stream);
void verify_tree_cuda(const VerifyTreeArgs& args, std::int64_t stream);

namespace vf {

// ---- loads (elements: dtype.h) --------------------------------------------------------
DSPEC_HD std::int64_t load_id(const void* base, int dtype, std::int64_t idx) {
  return dtype == kInt32 ? static_cast<std::int64_t>(static_cast<const std::int32_t*>(base)[idx])
                         : static_cast<const std::int64_t*>(base)[idx];
}

// ---- probabilities ----------------------------------------------------------------------
// a * b rounded (never contracted into an FMA with a following add / subtract by nvcc).
DSPEC_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The target's distribution at one row: the argmax logit and 1 / S, prob NaN for an invalid
// row (argmax -1), so every p of that row is NaN.
struct RowDist {
  float top_logit;
  float prob;
};

DSPEC_HD RowDist row_dist(const VerifyCommon& a, const std::int64_t* argmax, const float* prob, std::int64_t row) {
  const std::int64_t top = argmax[row];
  RowDist d;
  d.top_logit = dt::load(a.logits, a.dtype, row * a.row_stride + (top > 0 ? top : 0));
  d.prob = top >= 0 ? prob[row] : NAN;
  return d;
}

// p(v) = exp((logit_v - logit_argmax) * inv_t) * (1 / S), float32 as in the Triton kernels.
DSPEC_HD float target_p(float logit, const RowDist& d, float inv_t) {
  return mul_rn(expf(mul_rn(logit - d.top_logit, inv_t)), d.prob);
}

// max(p - q, 0) with NaN kept (a NaN in q poisons the draw: token -1, as the reference).
DSPEC_HD float residual(float p, float q) {
  const float r = p - q;
  return r < 0.0f ? 0.0f : r;
}

// ---- chain ------------------------------------------------------------------------------
DSPEC_HD std::int64_t chain_num_drafts(const VerifyChainArgs& a, std::int64_t b) {
  const std::int64_t length = a.positions - 1;
  if (a.num_drafts == nullptr) return length;
  const std::int64_t n = a.num_drafts[b];
  return n < 0 ? 0 : (n > length ? length : n);
}

// Is draft i (< n) of row b, token x, accepted?  Greedy: x == argmax.  Sampling:
// coin * q(x) < p(x) with q(x) = draft_probs[b, i, x] (1 without draft_probs).  An id
// outside [0, V) (possible only with value checks off) is never read and never accepted.
DSPEC_HD bool chain_accepts(const VerifyChainArgs& a, const std::int64_t* argmax, const float* prob, std::int64_t b,
                            std::int64_t i, std::int64_t x) {
  const std::int64_t row = b * a.positions + i;
  if (a.greedy) return x == argmax[row];
  if (x < 0 || x >= a.vocab) return false;
  const RowDist d = row_dist(a, argmax, prob, row);
  const float p_x = target_p(dt::load(a.logits, a.dtype, row * a.row_stride + x), d, a.inv_t);
  const float q_x = a.q != nullptr ? dt::load(a.q, a.q_dtype, b * a.q_stride_b + i * a.q_stride_l + x) : 1.0f;
  const float coin = a.coins[b * (a.positions - 1) + i];
  return coin * q_x < p_x;
}

// ---- chain, block rule ------------------------------------------------------------------
// Block verification (Sun et al., arXiv 2403.10444; dspec.verify_chain(rule="block")).
// p(x) and q(x) of draft i (< n) of row b, token x (q = 1 without draft_probs); an id outside
// [0, V) (value checks off) is never read: p = 0, q = 1, so w drops to 0 and it is never
// accepted.
DSPEC_HD void chain_draft_pq(const VerifyChainArgs& a, const std::int64_t* argmax, const float* prob, std::int64_t b,
                             std::int64_t i, std::int64_t x, float& p_x, float& q_x) {
  p_x = 0.0f;
  q_x = 1.0f;
  if (x < 0 || x >= a.vocab) return;
  const std::int64_t row = b * a.positions + i;
  const RowDist d = row_dist(a, argmax, prob, row);
  p_x = target_p(dt::load(a.logits, a.dtype, row * a.row_stride + x), d, a.inv_t);
  if (a.q != nullptr) q_x = dt::load(a.q, a.q_dtype, b * a.q_stride_b + i * a.q_stride_l + x);
}

// p / q, with +inf where q = 0 < p and 0 where both are 0 (NaN kept).
DSPEC_HD float block_ratio(float p, float q) {
  if (q == 0.0f) return p > 0.0f ? INFINITY : p * 0.0f;
  return p / q;
}

// w_{j+1} = min(w_j * ratio, 1), 0 when w_j is 0 (even for ratio +inf), NaN kept.
DSPEC_HD float block_w_next(float w, float ratio) {
  if (w == 0.0f) return w;
  const float t = mul_rn(w, ratio);
  return t > 1.0f ? 1.0f : t;
}

// h_j = R_j / (R_j + (1 - w_j)); 1 when that denominator is <= 0 (R_j = 0 and w_j = 1).
DSPEC_HD float block_h(float r, float w) {
  const float den = r + (1.0f - w);
  return den <= 0.0f ? 1.0f : r / den;
}

// One-hot drafts: R_j = sum_v max(w p(v) - [v == x], 0) = w (1 - p(x)).
DSPEC_HD float block_r_one_hot(float w, float p_x) { return mul_rn(w, 1.0f - p_x); }

// The walk's result: tau (num_accepted), the draft count cut at the first invalid target
// row, and w_tau (the draw's residual is max(w_tau p_tau - q_tau, 0) when tau < n_eff).
struct ChainBlock {
  std::int64_t tau;
  std::int64_t n_eff;
  float w_tau;
};

// The block rule for row b.  `ensure(row)` runs before a target row is first read (the CPU's
// lazy stage 1); `r_sum(j, w_j)` gives R_j = sum_v max(w_j p_j(v) - q_j(v), 0) for
// 1 <= j < n_eff when there are draft_probs (one-hot drafts: block_r_one_hot).  A row's first
// invalid target row (argmax -1) cuts its drafts there and plays the bonus row's part.
// tau = the largest j in 1..n_eff with coins[b, j - 1] < h_j (h_{n_eff} = w_{n_eff}), else 0.
template <class Ensure, class RSum>
DSPEC_HD ChainBlock chain_block_walk(const VerifyChainArgs& a, const std::int64_t* argmax, const float* prob,
                                     std::int64_t b, Ensure ensure, RSum r_sum) {
  const std::int64_t positions = a.positions, length = positions - 1;
  const std::int64_t n = chain_num_drafts(a, b);
  const float* coins = a.coins + b * length;
  ChainBlock res;
  res.tau = 0;
  res.n_eff = n;
  res.w_tau = 1.0f;
  float w = 1.0f;
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t row = b * positions + j;
    ensure(row);
    if (argmax[row] < 0) {
      res.n_eff = j;
      break;
    }
    const std::int64_t x = load_id(a.drafts, a.draft_dtype, b * length + j);
    float p_x, q_x;
    chain_draft_pq(a, argmax, prob, b, j, x, p_x, q_x);
    if (j >= 1) {
      const float r = a.q != nullptr ? r_sum(j, w) : block_r_one_hot(w, p_x);
      if (coins[j - 1] < block_h(r, w)) {
        res.tau = j;
        res.w_tau = w;
      }
    }
    w = block_w_next(w, block_ratio(p_x, q_x));
  }
  if (res.n_eff >= 1 && coins[res.n_eff - 1] < w) {
    res.tau = res.n_eff;
    res.w_tau = w;
  }
  return res;
}

// w_j of row b (j <= n, rows before j valid), as chain_block_walk computes it.
DSPEC_HD float chain_block_w(const VerifyChainArgs& a, const std::int64_t* argmax, const float* prob, std::int64_t b,
                             std::int64_t j) {
  const std::int64_t length = a.positions - 1;
  float w = 1.0f;
  for (std::int64_t i = 0; i < j; ++i) {
    float p_x, q_x;
    chain_draft_pq(a, argmax, prob, b, i, load_id(a.drafts, a.draft_dtype, b * length + i), p_x, q_x);
    w = block_w_next(w, block_ratio(p_x, q_x));
  }
  return w;
}

// ---- tree -------------------------------------------------------------------------------
// What the walk needs to know about node c, all independent of the walk's state: its parent
// (-1 unless in [0, c)), token, coin, p(token) under its parent's distribution (sampling),
// and whether its token is its parent's argmax (greedy).
struct TreeNode {
  std::int64_t parent;
  std::int64_t token;
  float p;
  float coin;
  bool match;
  float q;  // with draft_probs: q_parent(token) as given (0 for an id outside [0, V))
};

DSPEC_HD TreeNode tree_node(const VerifyTreeArgs& a, const std::int64_t* argmax, const float* prob, std::int64_t b,
                            std::int64_t c) {
  const std::int64_t base = b * a.positions;
  TreeNode nd;
  nd.parent = load_id(a.parents, a.parent_dtype, base + c);
  nd.token = load_id(a.tokens, a.token_dtype, base + c);
  nd.p = 0.0f;
  nd.coin = 1.0f;
  nd.match = false;
  nd.q = 0.0f;
  if (nd.parent < 0 || nd.parent >= c) {  // padding (or malformed): never anyone's child
    nd.parent = -1;
    return nd;
  }
  const std::int64_t prow = base + nd.parent;
  if (a.greedy) {
    nd.match = nd.token == argmax[prow];
    return nd;
  }
  nd.coin = a.coins[base + c];
  if (nd.token >= 0 && nd.token < a.vocab) {
    const RowDist d = row_dist(a, argmax, prob, prow);
    nd.p = target_p(dt::load(a.logits, a.dtype, prow * a.row_stride + nd.token), d, a.inv_t);
    if (a.q != nullptr) nd.q = dt::load(a.q, a.q_dtype, b * a.q_stride_b + nd.parent * a.q_stride_n + nd.token);
  }
  return nd;
}

// State of one row's walk: the current node, the accepted depth, and at the current node
// the number of excluded (rejected, distinct) sibling tokens and their probability mass.
// With draft_probs (tree_q_*): the residual r of the current node is P_node until a
// rejection materialises it (has_resid: the workspace row holds r unnormalised, s_r its
// sum); without replacement the nex excluded tokens are those removed from q_cur =
// q_node / d_q (d_q = 1 until a removal, then the sum of q_node over the kept tokens).
struct TreeWalk {
  std::int64_t node;
  std::int64_t depth;
  std::int32_t nex;
  float removed;
  float s_r;
  float d_q;
  bool has_resid;
};

DSPEC_HD TreeWalk tree_walk_start() {
  TreeWalk s;
  s.node = 0;
  s.depth = 0;
  s.nex = 0;
  s.removed = 0.0f;
  s.s_r = 1.0f;
  s.d_q = 1.0f;
  s.has_resid = false;
  return s;
}

DSPEC_HD bool tree_seen(const std::int64_t* excl, std::int32_t nex, std::int64_t token) {
  bool seen = false;
  for (std::int32_t k = 0; k < nex; ++k) seen = seen || excl[k] == token;
  return seen;
}

// One step of the walk at node index c (as _tree_walk_kernel).  Greedy: move to c iff it is
// a child of the current node holding the current argmax.  Sampling: w = 0 for a token
// already excluded at this node, else p; move iff coin < w / (1 - removed); a rejected new
// token is excluded (drop = true: the caller stores nd.token at excl[s.nex - 1]) and its p
// joins `removed`.  A move resets the excluded list.  Returns whether it moved (then
// s.depth - 1 is the path slot of c).
DSPEC_HD bool tree_step(TreeWalk& s, std::int64_t c, const TreeNode& nd, bool greedy, bool seen, bool& drop) {
  drop = false;
  if (nd.parent != s.node) return false;
  bool move;
  if (greedy) {
    move = nd.match;
  } else {
    const float w = seen ? 0.0f : nd.p;
    move = nd.coin < w / (1.0f - s.removed);
    drop = !move && !seen;
    if (drop) {
      s.removed = s.removed + nd.p;
      s.nex += 1;
    }
  }
  if (move) {
    s.node = c;
    s.depth += 1;
    s.nex = 0;
    s.removed = 0.0f;
  }
  return move;
}

// The residual is used unless its total is exactly 0 (an empty residual: draw from p); a NaN
// total stays (token -1).
DSPEC_HD bool draw_use_p(float total_w) { return !(total_w > 0.0f) && total_w == total_w; }
DSPEC_HD bool draw_use_p(double total_w) { return !(total_w > 0.0) && total_w == total_w; }

// ---- tree with draft probabilities ---------------------------------------------------------
// Node c with the walk at node u: skipped unless c is a child of u whose q_cur(token) is
// nonzero (q_cur(x) = q_u(x) / d_q, 0 for a removed token: it could not have been drawn);
// accepted iff coin * q_cur(x) < r(x) / s_r (r_x: the residual row's value when has_resid,
// else nd.p); else rejected: the caller runs the residual pass (tree_q_residual per column,
// then tree_q_rejected with the pass's sums).
enum TreeQStep : int { kTreeQSkip = 0, kTreeQMove = 1, kTreeQReject = 2 };

DSPEC_HD int tree_q_decide(const TreeWalk& s, const TreeNode& nd, bool removed, float r_x) {
  if (nd.parent != s.node) return kTreeQSkip;
  const float q_x = removed ? 0.0f : nd.q;
  if (q_x == 0.0f) return kTreeQSkip;
  return mul_rn(nd.coin, q_x / s.d_q) < r_x / s.s_r ? kTreeQMove : kTreeQReject;
}

// The new residual of one column: max(r / s_r - q_cur, 0), NaN kept.  r_v: the residual
// row's value, or p when !has_resid; removed: the column is excluded from q_cur.
DSPEC_HD float tree_q_residual(const TreeWalk& s, float r_v, float q_v, bool removed) {
  return residual(r_v / s.s_r, (removed ? 0.0f : q_v) / s.d_q);
}

// After a rejection's pass: sum_r = the sum of the new residual (an empty one, 0 and not NaN,
// gives r = P_u again), sum_kept = the sum of q_u over the tokens still in q_cur (without
// replacement: the rejected token joins the nex excluded ones, which the caller stores).
DSPEC_HD void tree_q_rejected(TreeWalk& s, float sum_r, float sum_kept, bool without_replacement) {
  s.has_resid = !draw_use_p(sum_r);
  s.s_r = s.has_resid ? sum_r : 1.0f;
  if (without_replacement) {
    s.d_q = sum_kept;
    s.nex += 1;
  }
}

DSPEC_HD void tree_q_move(TreeWalk& s, std::int64_t c) {
  s.node = c;
  s.depth += 1;
  s.nex = 0;
  s.s_r = 1.0f;
  s.d_q = 1.0f;
  s.has_resid = false;
}

// ---- draw -------------------------------------------------------------------------------
// One column's weights: p, and w = the residual max(scale * p - q, 0) in mode 2, else p; 0
// for an excluded token.  (Mode 1 excludes tokens, mode 2 subtracts q; never both.)  scale
// is 1 (exact: w = max(p - q, 0)) but for the block rule's draw (w_tau).
DSPEC_HD void draw_weights(float logit, float q, bool excluded, int mode, const RowDist& d, float inv_t, float& w,
                           float& p, float scale = 1.0f) {
  p = target_p(logit, d, inv_t);
  w = mode == kModeResidualQ ? residual(mul_rn(scale, p), q) : p;
  w = excluded ? 0.0f : w;
}

}  // namespace vf
}  // namespace dspec
