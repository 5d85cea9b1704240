// verify_chain / verify_tree on the CPU: the design of the CUDA / Triton kernels, run
// sequentially per row (rows spread over std::thread workers for large inputs).
//
// Stage 1 is token_stats_cpu over every target row (argmax, 1 / S).  Then each row, on its
// own: the acceptance (dspec::vf::chain_accepts / the tree walk of dspec::vf::tree_step,
// the same float32 expressions as the kernels) and, when sampling, the draw: per-tile sums
// of the weights (float32 elements, double sums), the first tile whose running sum passes
// u * total (else the last tile with a nonzero sum), then the first token inside it whose
// running sum passes (else the last token with w > 0).  The draw spec stays in registers
// (the workspace's spec / tile sections are not used on the CPU).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_features.h"
#include "cpu_parallel.h"
#include "dspec.h"
#include "verify.h"

namespace dspec {
namespace {

// Below this many elements of work a call runs on the calling thread alone.
constexpr std::int64_t kParallelThreshold = std::int64_t(1) << 18;
constexpr std::int64_t kMinWorkPerThread = std::int64_t(1) << 16;

struct Scratch {
  std::vector<double> tw, tp;      // per-tile sums of w and p
  std::vector<std::uint8_t> have;  // lazy stage 1: which of the row's positions are scanned
  std::vector<std::int64_t> excl;  // tree: excluded tokens at the current node
  std::vector<std::int64_t> excl_sorted;
  std::vector<float> resid;  // tree with draft_probs: the current node's residual
};

struct CpuDrawSpec {
  std::int64_t row = 0;  // target row
  int mode = kModeP;
  const void* q_row = nullptr;  // draft_probs row (mode 2)
  int q_dtype = kFloat32;
  const std::int64_t* excl = nullptr;  // excluded tokens (mode 1)
  std::int32_t nex = 0;
  float scale = 1.0f;                // mode 2: w = max(scale * p - q, 0) (the block rule's w_tau)
  const float* resid_row = nullptr;  // mode 3: the weights themselves
};

// Weights of columns [lo, hi) of the draw row; `k` walks the sorted excluded tokens.
template <int DT, class Fn>
inline void for_columns(const VerifyCommon& a, const CpuDrawSpec& sp, const vf::RowDist& d,
                        const std::vector<std::int64_t>& ex, std::int64_t lo, std::int64_t hi, Fn fn) {
  std::size_t k = static_cast<std::size_t>(std::lower_bound(ex.begin(), ex.end(), lo) - ex.begin());
  const std::int64_t row_off = sp.row * a.row_stride;
  const bool with_q = sp.mode == kModeResidualQ && sp.q_row != nullptr;
  for (std::int64_t col = lo; col < hi; ++col) {
    while (k < ex.size() && ex[k] < col) ++k;
    const bool excluded = k < ex.size() && ex[k] == col;
    const float q = with_q ? dt::load(sp.q_row, sp.q_dtype, col) : 0.0f;
    float w, p;
    vf::draw_weights(dt::load<DT>(a.logits, row_off + col), q, excluded, sp.mode, d, a.inv_t, w, p, sp.scale);
    if (sp.mode == kModeResid) w = sp.resid_row[col];
    if (!fn(col, w, p)) return;
  }
}

#if DSPEC_AVX512_CODE
// draw_row's per-tile sums of w and p for AVX-512: 16 columns at a time, p = 2^((x - top)
// inv_t log2 e) * prob (exp as in token_stats' scan, so within a few ulp of target_p's
// expf), excluded tokens masked, each tile's sums in 8 + 8 double lanes.  The scalar scan
// inside the chosen tile stays for_columns'.  The scalar sums read ~1 GB/s: with 1088
// logits rows scanned at memory speed, 64 such draws doubled a T = 1 verify_chain.
template <int DT, int QDT>
DSPEC_AVX512 void tile_sums_avx512(const VerifyCommon& a, const CpuDrawSpec& sp, const vf::RowDist& d,
                                   const std::vector<std::int64_t>& ex, std::int64_t tile, std::int64_t num_tiles,
                                   double* tw, double* tp) {
  const auto* row = static_cast<const dt::elem_t<DT>*>(a.logits) + sp.row * a.row_stride;
  const auto* q = static_cast<const dt::elem_t<QDT>*>(sp.q_row);
  const bool with_q = sp.mode == kModeResidualQ && q != nullptr;
  const __m512 top = _mm512_set1_ps(d.top_logit), prob = _mm512_set1_ps(d.prob);
  const __m512 scale = _mm512_set1_ps(a.inv_t * 1.44269504088896341f), zero = _mm512_setzero_ps();
  std::size_t k = 0;
  for (std::int64_t t = 0; t < num_tiles; ++t) {
    const std::int64_t lo = t * tile, hi = std::min(a.vocab, lo + tile);
    __m512d w_lo = _mm512_setzero_pd(), w_hi = _mm512_setzero_pd(), p_lo = w_lo, p_hi = w_lo;
    for (std::int64_t c = lo; c < hi; c += 16) {
      const __mmask16 in = cpu::lanes(hi - c);
      const __m512 x = cpu::load_f32<DT>(row + c, in);
      const __m512 p = _mm512_maskz_mul_ps(in, cpu::exp2_nonpos16(_mm512_mul_ps(_mm512_sub_ps(x, top), scale)), prob);
      __m512 w = p;
      if (with_q) {
        const __m512 r = _mm512_sub_ps(p, cpu::load_f32<QDT>(q + c, in));
        w = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(r, zero, _CMP_LT_OQ), zero);  // NaN stays
      }
      while (k < ex.size() && ex[k] < c) ++k;
      __mmask16 excluded = 0;
      for (std::size_t e = k; e < ex.size() && ex[e] < c + 16; ++e) excluded |= __mmask16(1u << (ex[e] - c));
      w = _mm512_maskz_mov_ps(__mmask16(~excluded), w);
      w_lo = _mm512_add_pd(w_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(w)));
      w_hi = _mm512_add_pd(w_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1))));
      p_lo = _mm512_add_pd(p_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
      p_hi = _mm512_add_pd(p_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))));
    }
    tw[t] = _mm512_reduce_add_pd(_mm512_add_pd(w_lo, w_hi));
    tp[t] = _mm512_reduce_add_pd(_mm512_add_pd(p_lo, p_hi));
  }
}

template <int DT>
bool tile_sums_fast(const VerifyCommon& a, const CpuDrawSpec& sp, const vf::RowDist& d,
                    const std::vector<std::int64_t>& ex, std::int64_t tile, std::int64_t num_tiles, Scratch& s) {
  // the block rule's scaled residual takes the scalar sums (the exact float32 product)
  if (!cpu::has_avx512() || sp.scale != 1.0f) return false;
  double* tw = s.tw.data();
  double* tp = s.tp.data();
  const bool q16 = sp.mode == kModeResidualQ && sp.q_row != nullptr && sp.q_dtype != kFloat32;
  if (!q16) {
    tile_sums_avx512<DT, kFloat32>(a, sp, d, ex, tile, num_tiles, tw, tp);
  } else if (sp.q_dtype == kBFloat16) {
    tile_sums_avx512<DT, kBFloat16>(a, sp, d, ex, tile, num_tiles, tw, tp);
  } else {
    tile_sums_avx512<DT, kFloat16>(a, sp, d, ex, tile, num_tiles, tw, tp);
  }
  return true;
}
#else
template <int DT>
bool tile_sums_fast(const VerifyCommon&, const CpuDrawSpec&, const vf::RowDist&, const std::vector<std::int64_t>&,
                    std::int64_t, std::int64_t, Scratch&) {
  return false;
}
#endif

// The drawn token (-1 when the weights are empty or not finite).
template <int DT>
std::int64_t draw_row(const VerifyCommon& a, const VerifyWork& wk, const CpuDrawSpec& sp, float u, Scratch& s) {
  const vf::RowDist d = vf::row_dist(a, wk.argmax, wk.prob, sp.row);
  const std::int64_t vocab = a.vocab;
  const std::int64_t tile = draw_tile(DT);
  const std::int64_t num_tiles = draw_num_tiles(vocab, DT);

  auto& ex = s.excl_sorted;
  ex.clear();
  if (sp.mode == kModeExclude) {
    for (std::int32_t k = 0; k < sp.nex; ++k) {
      if (sp.excl[k] >= 0 && sp.excl[k] < vocab) ex.push_back(sp.excl[k]);
    }
    std::sort(ex.begin(), ex.end());
  }

  s.tw.assign(static_cast<std::size_t>(num_tiles), 0.0);
  s.tp.assign(static_cast<std::size_t>(num_tiles), 0.0);
  const bool summed = sp.mode != kModeResid && tile_sums_fast<DT>(a, sp, d, ex, tile, num_tiles, s);
  for (std::int64_t t = 0; t < num_tiles && !summed; ++t) {
    double sw = 0.0, spp = 0.0;
    for_columns<DT>(a, sp, d, ex, t * tile, std::min(vocab, (t + 1) * tile), [&](std::int64_t, float w, float p) {
      sw += w;
      spp += p;
      return true;
    });
    s.tw[static_cast<std::size_t>(t)] = sw;
    s.tp[static_cast<std::size_t>(t)] = spp;
  }
  double total_w = 0.0, total_p = 0.0;
  for (std::int64_t t = 0; t < num_tiles; ++t) {
    total_w += s.tw[static_cast<std::size_t>(t)];
    total_p += s.tp[static_cast<std::size_t>(t)];
  }
  const bool use_p = vf::draw_use_p(total_w);
  const std::vector<double>& ts = use_p ? s.tp : s.tw;
  // The total and the target u * total are float32 (as the reference's float sum and
  // product); running sums are double and compared after rounding to float32 (as the
  // reference's cumsum, accumulated in double and stored as float32).
  const float total = static_cast<float>(use_p ? total_p : total_w);
  if (!(total > 0.0f && total < INFINITY)) return -1;
  const float target = u * total;

  // the tile where the running sum passes the target (else the last nonzero tile)
  std::int64_t tile_at = -1, last_nonzero = -1;
  double cum = 0.0, before = 0.0, before_last_nonzero = 0.0;
  for (std::int64_t t = 0; t < num_tiles; ++t) {
    const double v = ts[static_cast<std::size_t>(t)];
    if (v > 0.0) {
      last_nonzero = t;
      before_last_nonzero = cum;
    }
    const double next = cum + v;
    if (static_cast<float>(next) > target) {
      tile_at = t;
      before = cum;
      break;
    }
    cum = next;
  }
  if (tile_at < 0) {
    tile_at = last_nonzero;
    before = before_last_nonzero;
  }
  if (tile_at < 0) return -1;

  // the token inside it (else the tile's last token with a nonzero weight)
  std::int64_t hit = -1, last = -1;
  double running = before;
  for_columns<DT>(a, sp, d, ex, tile_at * tile, std::min(vocab, (tile_at + 1) * tile),
                  [&](std::int64_t col, float w, float p) {
                    const float v = use_p ? p : w;
                    if (v > 0.0f) last = col;
                    running += v;
                    if (static_cast<float>(running) > target) {
                      hit = col;
                      return false;
                    }
                    return true;
                  });
  return hit >= 0 ? hit : last;
}

// Stage 1 on demand: the stats of one row (b's position i) before its first read, when
// verify_*_cpu chose lazy rows (else stage1 computed every row).
struct RowStats {
  const TokenStatsArgs* ts = nullptr;  // null: every row is already there
  std::int64_t base = 0;               // the request's first row
  // next_row >= 0: the row the caller will read after this one (the scan's exp pass brings it
  // into L2: a sampled verification reads about one row per request, so without it every
  // request's first row waited on memory)
  void ensure(std::int64_t row, Scratch& s, std::int64_t next_row = -1) const {
    if (ts == nullptr || s.have[static_cast<std::size_t>(row - base)]) return;
    token_stats_row_cpu(*ts, row, next_row);
    s.have[static_cast<std::size_t>(row - base)] = 1;
  }
};

// R_j = sum_v max(w p_j(v) - q_j(v), 0) of row b's position j (float32 terms, double sum).
template <int DT>
float block_r_sum(const VerifyChainArgs& a, const VerifyWork& wk, std::int64_t b, std::int64_t j, float w) {
  const std::int64_t row = b * a.positions + j;
  const vf::RowDist d = vf::row_dist(a, wk.argmax, wk.prob, row);
  const auto* logits = static_cast<const dt::elem_t<DT>*>(a.logits) + row * a.row_stride;
  const char* q_row =
      static_cast<const char*>(a.q) + (b * a.q_stride_b + j * a.q_stride_l) * (a.q_dtype == kFloat32 ? 4 : 2);
  double sum = 0.0;
  for (std::int64_t col = 0; col < a.vocab; ++col) {
    const float p = vf::target_p(dt::to_float<DT>(logits[col]), d, a.inv_t);
    sum += vf::residual(vf::mul_rn(w, p), dt::load(q_row, a.q_dtype, col));
  }
  return static_cast<float>(sum);
}

// The block rule's row b (sampling): vf::chain_block_walk, then the draw at tau.
template <int DT>
void chain_block_row(const VerifyChainArgs& a, const VerifyWork& wk, std::int64_t b, Scratch& s, const RowStats& rows) {
  const std::int64_t positions = a.positions, length = positions - 1;
  const vf::ChainBlock r = vf::chain_block_walk(
      a, wk.argmax, wk.prob, b,
      [&](std::int64_t row) {
        rows.ensure(row, s, row == b * positions && b + 1 < a.batch ? (b + 1) * positions : -1);
      },
      [&](std::int64_t j, float w) { return block_r_sum<DT>(a, wk, b, j, w); });
  const std::int64_t tau = r.tau;
  std::int64_t* out = a.tokens + b * positions;
  for (std::int64_t i = 0; i < positions; ++i)
    out[i] = i < tau ? vf::load_id(a.drafts, a.draft_dtype, b * length + i) : -1;
  a.num_accepted[b] = tau;
  rows.ensure(b * positions + tau, s);
  const bool rejected = tau < r.n_eff;
  std::int64_t x_tau = rejected ? vf::load_id(a.drafts, a.draft_dtype, b * length + tau) : -1;
  CpuDrawSpec sp;
  sp.row = b * positions + tau;
  sp.mode = rejected ? (a.q != nullptr ? kModeResidualQ : kModeExclude) : kModeP;
  if (sp.mode == kModeResidualQ) {
    sp.q_dtype = a.q_dtype;
    sp.q_row =
        static_cast<const char*>(a.q) + (b * a.q_stride_b + tau * a.q_stride_l) * (a.q_dtype == kFloat32 ? 4 : 2);
    sp.scale = r.w_tau;
  }
  sp.excl = &x_tau;
  sp.nex = sp.mode == kModeExclude ? 1 : 0;
  out[tau] = draw_row<DT>(a, wk, sp, a.uniforms[b], s);
}

template <int DT>
void chain_row(const VerifyChainArgs& a, const VerifyWork& wk, std::int64_t b, Scratch& s, RowStats rows) {
  const std::int64_t positions = a.positions, length = positions - 1;
  const std::int64_t n = vf::chain_num_drafts(a, b);
  rows.base = b * positions;
  if (rows.ts != nullptr) s.have.assign(static_cast<std::size_t>(positions), 0);
  if (a.block && !a.greedy) {
    chain_block_row<DT>(a, wk, b, s, rows);
    return;
  }
  std::int64_t j = n;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t x = vf::load_id(a.drafts, a.draft_dtype, b * length + i);
    rows.ensure(b * positions + i, s, i == 0 && b + 1 < a.batch ? (b + 1) * positions : -1);
    if (!vf::chain_accepts(a, wk.argmax, wk.prob, b, i, x)) {
      j = i;
      break;
    }
  }
  std::int64_t* out = a.tokens + b * positions;
  for (std::int64_t i = 0; i < positions; ++i)
    out[i] = i < j ? vf::load_id(a.drafts, a.draft_dtype, b * length + i) : -1;
  a.num_accepted[b] = j;
  rows.ensure(b * positions + j, s);
  if (a.greedy) {
    out[j] = wk.argmax[b * positions + j];
    return;
  }
  const bool rejected = j < n;
  std::int64_t x_j = rejected ? vf::load_id(a.drafts, a.draft_dtype, b * length + j) : -1;
  CpuDrawSpec sp;
  sp.row = b * positions + j;
  sp.mode = rejected ? (a.q != nullptr ? kModeResidualQ : kModeExclude) : kModeP;
  if (sp.mode == kModeResidualQ) {
    sp.q_dtype = a.q_dtype;
    sp.q_row = static_cast<const char*>(a.q) + (b * a.q_stride_b + j * a.q_stride_l) * (a.q_dtype == kFloat32 ? 4 : 2);
  }
  sp.excl = &x_j;
  sp.nex = sp.mode == kModeExclude ? 1 : 0;
  out[j] = draw_row<DT>(a, wk, sp, a.uniforms[b], s);
}

template <int DT>
void tree_row(const VerifyTreeArgs& a, const VerifyWork& wk, std::int64_t b, Scratch& s, RowStats rows) {
  const std::int64_t nodes = a.positions, base = b * nodes;
  rows.base = base;
  if (rows.ts != nullptr) s.have.assign(static_cast<std::size_t>(nodes), 0);
  std::int64_t* path = a.path + base;
  std::int64_t* out = a.out + base;
  for (std::int64_t d = 0; d < nodes; ++d) path[d] = out[d] = -1;
  s.excl.assign(static_cast<std::size_t>(nodes), -1);
  vf::TreeWalk st = vf::tree_walk_start();
  for (std::int64_t c = 1; c < nodes; ++c) {
    // cheap pre-check (tree_node is pure: skipping non-children changes nothing)
    if (vf::load_id(a.parents, a.parent_dtype, base + c) != st.node) continue;
    rows.ensure(base + st.node, s, st.node == 0 && b + 1 < a.batch ? base + nodes : -1);
    const vf::TreeNode nd = vf::tree_node(a, wk.argmax, wk.prob, b, c);
    const bool seen = !a.greedy && vf::tree_seen(s.excl.data(), st.nex, nd.token);
    bool drop;
    const bool move = vf::tree_step(st, c, nd, a.greedy, seen, drop);
    if (drop) s.excl[static_cast<std::size_t>(st.nex - 1)] = nd.token;
    if (move) {
      path[st.depth - 1] = c;
      out[st.depth - 1] = nd.token;
    }
  }
  a.num_accepted[b] = st.depth;
  rows.ensure(base + st.node, s);
  if (a.greedy) {
    out[st.depth] = wk.argmax[base + st.node];
    return;
  }
  CpuDrawSpec sp;
  sp.row = base + st.node;
  sp.mode = st.nex > 0 ? kModeExclude : kModeP;
  sp.excl = s.excl.data();
  sp.nex = st.nex;
  out[st.depth] = draw_row<DT>(a, wk, sp, a.uniforms[b], s);
}

// tree_row with draft probabilities (sampling): the walk of dspec::vf::tree_q_*, the residual
// of the current node in s.resid (one pass over V per rejection, sums in double), the final
// token drawn from it (or from P where no rejection left one).
template <int DT>
void tree_row_q(const VerifyTreeArgs& a, const VerifyWork& wk, std::int64_t b, Scratch& s, RowStats rows) {
  const std::int64_t nodes = a.positions, base = b * nodes, vocab = a.vocab;
  rows.base = base;
  if (rows.ts != nullptr) s.have.assign(static_cast<std::size_t>(nodes), 0);
  std::int64_t* path = a.path + base;
  std::int64_t* out = a.out + base;
  for (std::int64_t d = 0; d < nodes; ++d) path[d] = out[d] = -1;
  s.resid.resize(static_cast<std::size_t>(vocab));
  auto& removed = s.excl_sorted;  // without replacement: the tokens removed from q_cur, sorted
  removed.clear();
  const std::size_t q_size = a.q_dtype == kFloat32 ? 4 : 2;
  vf::TreeWalk st = vf::tree_walk_start();
  for (std::int64_t c = 1; c < nodes; ++c) {
    if (vf::load_id(a.parents, a.parent_dtype, base + c) != st.node) continue;
    rows.ensure(base + st.node, s, st.node == 0 && b + 1 < a.batch ? base + nodes : -1);
    const vf::TreeNode nd = vf::tree_node(a, wk.argmax, wk.prob, b, c);
    const bool is_removed = std::binary_search(removed.begin(), removed.end(), nd.token);
    const float r_x =
        st.has_resid && nd.token >= 0 && nd.token < vocab ? s.resid[static_cast<std::size_t>(nd.token)] : nd.p;
    const int step = vf::tree_q_decide(st, nd, is_removed, r_x);
    if (step == vf::kTreeQMove) {
      vf::tree_q_move(st, c);
      removed.clear();
      path[st.depth - 1] = c;
      out[st.depth - 1] = nd.token;
    } else if (step == vf::kTreeQReject) {
      const std::int64_t row = base + st.node;
      const vf::RowDist d = vf::row_dist(a, wk.argmax, wk.prob, row);
      const auto* logits = static_cast<const dt::elem_t<DT>*>(a.logits) + row * a.row_stride;
      const char* q_row =
          static_cast<const char*>(a.q) + static_cast<std::size_t>(b * a.q_stride_b + st.node * a.q_stride_n) * q_size;
      double sum_r = 0.0, sum_kept = 0.0;
      std::size_t k = 0;
      for (std::int64_t col = 0; col < vocab; ++col) {
        while (k < removed.size() && removed[k] < col) ++k;
        const bool gone = k < removed.size() && removed[k] == col;
        const float q_v = dt::load(q_row, a.q_dtype, col);
        const float r_v = st.has_resid ? s.resid[static_cast<std::size_t>(col)]
                                       : vf::target_p(dt::to_float<DT>(logits[col]), d, a.inv_t);
        const float r_new = vf::tree_q_residual(st, r_v, q_v, a.without_replacement && gone);
        s.resid[static_cast<std::size_t>(col)] = r_new;
        sum_r += r_new;
        if (!gone && col != nd.token) sum_kept += q_v;
      }
      vf::tree_q_rejected(st, static_cast<float>(sum_r), static_cast<float>(sum_kept), a.without_replacement);
      if (a.without_replacement) removed.insert(std::upper_bound(removed.begin(), removed.end(), nd.token), nd.token);
    }
  }
  a.num_accepted[b] = st.depth;
  rows.ensure(base + st.node, s);
  CpuDrawSpec sp;
  sp.row = base + st.node;
  sp.mode = st.has_resid ? kModeResid : kModeP;
  sp.resid_row = s.resid.data();
  out[st.depth] = draw_row<DT>(a, wk, sp, a.uniforms[b], s);
}

// Runs row_fn(b, scratch) for every row, on several threads when the work is large: the
// requests in a few chunks per thread taken in turn, since requests that accept more drafts
// (or scan more rows, lazily) take longer.
template <class RowFn>
void for_rows(std::int64_t batch, std::int64_t work_per_row, int num_threads, RowFn row_fn) {
  const std::int64_t work = batch * std::max<std::int64_t>(work_per_row, 1);
  std::int64_t threads = 1;
  if (work >= kParallelThreshold) {
    threads = std::min<std::int64_t>({static_cast<std::int64_t>(cpu::max_threads()), std::max(num_threads, 1),
                                      std::max<std::int64_t>(1, work / kMinWorkPerThread)});
    threads = std::min(threads, batch);
  }
  const std::int64_t chunks = threads <= 1 ? 1 : std::min<std::int64_t>(batch, 4 * threads);
  cpu::parallel_chunks(static_cast<int>(chunks), static_cast<int>(threads), [&](int c) {
    Scratch s;
    const std::int64_t b0 = batch * c / chunks, b1 = batch * (c + 1) / chunks;
    for (std::int64_t b = b0; b < b1; ++b) row_fn(b, s);
  });
}

// Lazy rows (CPU only): with at least as many requests as threads, each request scans its
// rows itself, in the order the acceptance reads them, and none past the row it stops at --
// a chain never reads the rows after its first rejection, a tree only the nodes it walks
// (the GPU layout scans all B x P rows up front for parallelism).  The values are those of
// the up-front scan (token_stats_row_cpu).
template <class Args>
bool lazy_rows(const Args& a) {
  return a.batch >= std::min<std::int64_t>(std::max(a.num_threads, 1), cpu::max_threads());
}

template <class Args>
VerifyWork stage1(const Args& a, std::int64_t excl_cap, bool lazy) {
  const VerifyLayout l = verify_layout(a.batch, a.positions, a.vocab, a.dtype, excl_cap, !a.greedy, a.ts_splits);
  const VerifyWork wk = verify_work(a.workspace, l);
  if (!lazy) token_stats_cpu(verify_token_stats_args(a, wk));
  return wk;
}

// A request's work after stage 1, for for_rows' thread count: its rows when they are
// scanned lazily, else the draw's row (sampling) or nothing but the acceptance (greedy).
template <class Args>
std::int64_t row_work(const Args& a, const RowStats& stats) {
  if (stats.ts != nullptr) return a.positions * std::max<std::int64_t>(a.vocab, 1);
  return a.greedy ? a.positions : a.vocab + a.positions;
}

template <int DT>
void chain_rows(const VerifyChainArgs& a, const VerifyWork& wk, const RowStats& stats) {
  for_rows(a.batch, row_work(a, stats), a.num_threads,
           [&](std::int64_t b, Scratch& s) { chain_row<DT>(a, wk, b, s, stats); });
}

template <int DT>
void tree_rows(const VerifyTreeArgs& a, const VerifyWork& wk, const RowStats& stats) {
  const bool with_q = !a.greedy && a.q != nullptr;
  for_rows(a.batch, row_work(a, stats), a.num_threads, [&](std::int64_t b, Scratch& s) {
    if (with_q) {
      tree_row_q<DT>(a, wk, b, s, stats);
    } else {
      tree_row<DT>(a, wk, b, s, stats);
    }
  });
}

}  // namespace

void verify_chain_cpu(const VerifyChainArgs& a) {
  if (a.batch <= 0) return;
  const bool lazy = lazy_rows(a);
  const VerifyWork wk = stage1(a, 1, lazy);  // the block rule's workspace sections: CUDA only
  const TokenStatsArgs ts = verify_token_stats_args(a, wk);
  const RowStats stats{lazy ? &ts : nullptr, 0};
  switch (a.dtype) {
    case kFloat32: chain_rows<kFloat32>(a, wk, stats); break;
    case kFloat16: chain_rows<kFloat16>(a, wk, stats); break;
    default: chain_rows<kBFloat16>(a, wk, stats); break;
  }
}

void verify_tree_cpu(const VerifyTreeArgs& a) {
  if (a.batch <= 0) return;
  const bool lazy = lazy_rows(a);
  const VerifyWork wk = stage1(a, a.positions, lazy);
  const TokenStatsArgs ts = verify_token_stats_args(a, wk);
  const RowStats stats{lazy ? &ts : nullptr, 0};
  switch (a.dtype) {
    case kFloat32: tree_rows<kFloat32>(a, wk, stats); break;
    case kFloat16: tree_rows<kFloat16>(a, wk, stats); break;
    default: tree_rows<kBFloat16>(a, wk, stats); break;
  }
}

}  // namespace dspec
