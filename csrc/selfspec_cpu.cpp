// The self-speculative engine's round on the CPU (selfspec.h): expand, score, advance.
//
// Each reproduces a step of selfspec.SelfSpecEngine's torch composition bit for bit (the same
// comparisons, the same float operations in the same order): ranks by a stable sort on
// confidence (ties to the lower slot), node scores as the running float sum of candidate
// log-probabilities divided by the node's size, pruning by the path-monotone score and a
// stable sort, first-maximum argmaxes.  Slots are scored with token_stats' row scan (the
// argmax and log-normaliser token_stats gives a multi-row call) and topk_cpu (candidates
// beyond the choice), so confidences and candidates are the torch path's values.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_parallel.h"
#include "dspec.h"
#include "dtype.h"
#include "masks.h"
#include "selfspec.h"
#include "topk.h"

namespace dspec {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

std::int64_t align8(std::int64_t b) { return (b + 7) / 8 * 8; }

struct Ws {  // typed views of the workspace
  std::int64_t *order, *rank, *node_tokens, *node_copy, *copy_node, *anchor, *num_kept, *anchor_copy, *choice, *cand,
      *header;
  float *logp, *cand_logp, *score, *closed;
  std::uint8_t *node_masked, *kept, *complete, *has_anchor, *copy_masked;
};

Ws views(std::uint8_t* base, const SelfSpecLayout& l) {
  auto i64 = [&](std::int64_t off) { return reinterpret_cast<std::int64_t*>(base + off); };
  auto f32 = [&](std::int64_t off) { return reinterpret_cast<float*>(base + off); };
  return Ws{i64(l.order),         i64(l.rank),     i64(l.node_tokens), i64(l.node_copy),    i64(l.copy_node),
            i64(l.anchor),        i64(l.num_kept), i64(l.anchor_copy), i64(l.choice),       i64(l.cand),
            i64(l.header),        f32(l.logp),     f32(l.cand_logp),   f32(l.score),        f32(l.closed),
            base + l.node_masked, base + l.kept,   base + l.complete,  base + l.has_anchor, base + l.copy_masked};
}

// Element e of a logits row as float (bf16 / f16 widen exactly).
float element(const void* row, int dtype, std::int64_t e) {
  switch (dtype) {
    case kFloat16: return dt::half_to_float(static_cast<const std::uint16_t*>(row)[e]);
    case kBFloat16: return dt::bf16_to_float(static_cast<const std::uint16_t*>(row)[e]);
    default: return static_cast<const float*>(row)[e];
  }
}

const void* row_at(const void* base, int dtype, std::int64_t offset) {
  const std::int64_t bytes = dtype == kFloat32 ? 4 : 2;
  return static_cast<const char*>(base) + offset * bytes;
}

}  // namespace

SelfSpecLayout selfspec_layout(std::int64_t rows, std::int64_t bs, std::int64_t nodes, std::int64_t big_j) {
  SelfSpecLayout l{};
  const std::int64_t slots = rows * (nodes + 1) * bs;  // every segment's slots (M copies + next block)
  std::int64_t at = 0;
  auto take = [&](std::int64_t bytes) {
    const std::int64_t off = at;
    at += align8(bytes);
    return off;
  };
  l.header = take(8 * 8);
  l.order = take(rows * bs * 8);
  l.rank = take(rows * bs * 8);
  l.node_tokens = take(rows * nodes * bs * 8);
  l.node_copy = take(rows * nodes * 8);
  l.copy_node = take(rows * nodes * 8);
  l.anchor = take(rows * 8);
  l.num_kept = take(rows * 8);
  l.anchor_copy = take(rows * 8);
  l.choice = take(slots * 8);
  l.cand = take(slots * big_j * 8);
  l.logp = take(slots * 4);
  l.cand_logp = take(slots * big_j * 4);
  l.score = take(rows * nodes * 4);
  l.closed = take(rows * nodes * 4);
  l.node_masked = take(rows * nodes * bs);
  l.kept = take(rows * nodes);
  l.complete = take(rows * nodes);
  l.has_anchor = take(rows);
  l.copy_masked = take(slots);
  l.bytes = at;
  return l;
}

SelfSpecCopies selfspec_expand_cpu(const SelfSpecExpandArgs& a) {
  const SelfSpecGraph& g = a.graph;
  const SelfSpecState& st = a.state;
  const std::int64_t A = a.rows, bs = a.block_size, M = g.nodes, I = g.max_rank, J = a.big_j;
  const SelfSpecLayout lay = selfspec_layout(A, bs, M, J);
  Ws w = views(a.workspace, lay);
  const bool prune = a.prune_to >= 0 && a.prune_to < M - 1;
  std::vector<std::int64_t> idx(static_cast<std::size_t>(std::max(M, bs)));
  std::vector<float> conf_m(static_cast<std::size_t>(bs));
  std::int64_t copies = 0;
  bool need_next = false;

  for (std::int64_t r = 0; r < A; ++r) {
    const float* conf = st.conf + r * bs;
    const std::uint8_t* masked = st.masked + r * bs;
    const bool known = st.known[r] != 0;
    std::int64_t* order = w.order + r * bs;
    std::int64_t* rank = w.rank + r * bs;
    // rank_masked: stable sort by confidence, descending; unmasked slots at -1
    std::int64_t mcount = 0;
    for (std::int64_t s = 0; s < bs; ++s) {
      conf_m[s] = masked[s] ? conf[s] : -1.0f;
      mcount += masked[s] != 0;
      order[s] = s;
    }
    std::stable_sort(order, order + bs, [&](std::int64_t x, std::int64_t y) { return conf_m[x] > conf_m[y]; });
    for (std::int64_t i = 0; i < bs; ++i) rank[order[i]] = i;

    std::int64_t* ntok = w.node_tokens + r * M * bs;
    std::uint8_t* nmask = w.node_masked + r * M * bs;
    float* score = w.score + r * M;
    float* closed = w.closed + r * M;
    std::uint8_t* kept = w.kept + r * M;
    std::uint8_t* complete = w.complete + r * M;
    for (std::int64_t n = 0; n < M; ++n) {
      std::int64_t* t = ntok + n * bs;
      std::uint8_t* m = nmask + n * bs;
      std::memcpy(t, st.tokens + r * bs, static_cast<std::size_t>(bs) * 8);
      std::memcpy(m, masked, static_cast<std::size_t>(bs));
      float logp_sum = 0.0f;
      if (known) {
        for (std::int64_t i = 0; i < a.ranks_used; ++i) {
          const std::int64_t j = g.assign[n * I + i];
          if (j < 0) continue;
          const std::int64_t slot = order[i];
          t[slot] = st.cand[(r * bs + slot) * J + j];
          m[slot] = 0;
          logp_sum = logp_sum + st.cand_logp[(r * bs + slot) * J + j];
        }
      }
      const std::int64_t top = g.top_rank[n];
      const bool valid = known ? (top < bs && top < mcount) : n == 0;
      complete[n] = valid && known && g.size[n] == mcount;
      score[n] = valid ? logp_sum / static_cast<float>(g.size[n]) : kNegInf;
      kept[n] = valid;
    }
    // online pruning: the path-monotone score, the best prune_to + 1 by a stable sort
    if (prune) {
      closed[0] = kPosInf;
      for (std::int64_t n = 1; n < M; ++n) {
        float best = kNegInf;
        bool first = true;
        for (std::int64_t p = g.parent_ptr[n]; p < g.parent_ptr[n + 1]; ++p) {
          const float v = closed[g.parent_idx[p]];
          if (first || v > best) best = v;
          first = false;
        }
        closed[n] = std::min(score[n], best);
      }
      for (std::int64_t n = 0; n < M; ++n) idx[n] = n;
      std::stable_sort(idx.begin(), idx.begin() + M,
                       [&](std::int64_t x, std::int64_t y) { return closed[x] > closed[y]; });
      std::vector<std::uint8_t> top_set(static_cast<std::size_t>(M), 0);
      for (std::int64_t k = 0; k <= a.prune_to; ++k) top_set[idx[k]] = 1;
      for (std::int64_t n = 0; n < M; ++n) kept[n] = kept[n] && top_set[n];
    } else {
      std::copy(score, score + M, closed);
    }
    std::int64_t anchor = 0, num_kept = 0;
    float best = kNegInf;
    bool has_anchor = false;
    for (std::int64_t n = 0; n < M; ++n) {
      num_kept += kept[n];
      const bool ok = complete[n] && kept[n];
      has_anchor = has_anchor || ok;
      const float v = ok ? closed[n] : kNegInf;
      if (n == 0 || v > best) {
        best = v;
        anchor = n;
      }
    }
    w.anchor[r] = anchor;
    w.num_kept[r] = num_kept;
    w.has_anchor[r] = has_anchor;
    copies = std::max(copies, num_kept);
    need_next = need_next || has_anchor;
  }

  // the forward's layout: kept nodes first (node order), then the others as padding copies
  const std::int64_t seg = copies + (need_next ? 1 : 0), N = seg * bs, W = mask_words(N);
  for (std::int64_t r = 0; r < A; ++r) {
    const std::uint8_t* kept = w.kept + r * M;
    std::int64_t* node_copy = w.node_copy + r * M;
    std::int64_t* copy_node = w.copy_node + r * M;
    std::int64_t c = 0;
    for (std::int64_t n = 0; n < M; ++n) {
      node_copy[n] = kept[n] ? c : -1;
      if (kept[n]) copy_node[c++] = n;
    }
    for (std::int64_t n = 0; n < M; ++n) {
      if (!kept[n]) copy_node[c++] = n;
    }
    const std::int64_t anchor_copy = std::max<std::int64_t>(node_copy[w.anchor[r]], 0);
    w.anchor_copy[r] = anchor_copy;
    std::int64_t* suffix = a.suffix + r * N;
    std::int64_t* pos = a.positions + r * N;
    std::uint8_t* cm = w.copy_masked + r * N;
    for (std::int64_t k = 0; k < copies; ++k) {
      const std::int64_t n = copy_node[k];
      std::memcpy(suffix + k * bs, w.node_tokens + (r * M + n) * bs, static_cast<std::size_t>(bs) * 8);
      std::memcpy(cm + k * bs, w.node_masked + (r * M + n) * bs, static_cast<std::size_t>(bs));
      for (std::int64_t s = 0; s < bs; ++s) pos[k * bs + s] = a.lengths[r] + s;
    }
    if (need_next) {
      for (std::int64_t s = 0; s < bs; ++s) {
        suffix[copies * bs + s] = a.mask_id;
        cm[copies * bs + s] = 1;
        pos[copies * bs + s] = a.lengths[r] + bs + s;
      }
    }
    // each copy sees itself; the next block's state also sees its anchor copy
    std::int32_t* words = a.words + r * N * W;
    std::memset(words, 0, static_cast<std::size_t>(N * W) * 4);
    auto set_keys = [&](std::int32_t* row, std::int64_t copy) {
      for (std::int64_t key = copy * bs; key < (copy + 1) * bs; ++key) {
        row[key / 32] = static_cast<std::int32_t>(static_cast<std::uint32_t>(row[key / 32]) | (1u << (key % 32)));
      }
    };
    for (std::int64_t q = 0; q < N; ++q) {
      const std::int64_t copy = q / bs;
      set_keys(words + q * W, copy);
      if (copy == copies && w.has_anchor[r]) set_keys(words + q * W, anchor_copy);
    }
  }
  w.header[0] = A;
  w.header[1] = copies;
  w.header[2] = need_next;
  w.header[3] = 1;  // expanded: score may run
  w.header[4] = M;
  w.header[5] = J;
  w.header[6] = bs;
  return SelfSpecCopies{copies, need_next};
}

void selfspec_score_cpu(const SelfSpecScoreArgs& a) {
  const std::int64_t A = a.rows, bs = a.block_size, J = a.big_j, V = a.vocab;
  const std::int64_t seg = a.copies + (a.need_next ? 1 : 0), slots = A * seg * bs;
  Ws w = views(a.workspace, selfspec_layout(A, bs, a.nodes, J));
  auto body = [&](std::int64_t lo, std::int64_t hi) {
    std::vector<std::int64_t> top(static_cast<std::size_t>(J));
    std::vector<float> top_p(static_cast<std::size_t>(J));
    for (std::int64_t k = lo; k < hi; ++k) {
      const std::int64_t r = k / (seg * bs), c = k / bs % seg, s = k % bs;
      // the logits that score slot s of copy c: a right-shifted model scores slot s with row
      // s - 1 of its copy, slot 0 with the carry (the next block's state: its anchor copy's last row)
      const void* row;
      int dtype = a.dtype;
      if (!a.shifted) {
        row = row_at(a.logits, a.dtype, k * a.row_stride);
      } else if (s > 0) {
        row = row_at(a.logits, a.dtype, (k - 1) * a.row_stride);
      } else if (a.need_next && c == a.copies) {
        row = row_at(a.logits, a.dtype, ((r * seg + w.anchor_copy[r]) * bs + bs - 1) * a.row_stride);
      } else {
        row = a.carry + r * V;
        dtype = kFloat32;
      }
      TokenStatsArgs ts;
      std::int64_t token = 0;
      float prob = 0.0f, margin = 0.0f, entropy = 0.0f, lse = 0.0f;
      ts.logits = row;
      ts.dtype = dtype;
      ts.rows = 1;
      ts.vocab = V;
      ts.row_stride = V;
      ts.token = &token;
      ts.prob = &prob;
      ts.margin = &margin;
      ts.entropy = &entropy;
      ts.lse = &lse;
      token_stats_row_cpu(ts, 0);
      const bool masked = w.copy_masked[k] != 0;
      const std::int64_t choice = masked ? token : 0;
      w.choice[k] = choice;
      // a non-finite row's choice is the -1 mark (its logp NaN): never read before the row
      const float nan = std::numeric_limits<float>::quiet_NaN();
      a.logp[k] = !masked ? kNegInf : choice < 0 ? nan : element(row, dtype, choice) - lse;
      // candidates: the choice, then the most likely other tokens (probability order)
      std::int64_t* cand = w.cand + k * J;
      float* cand_logp = w.cand_logp + k * J;
      cand[0] = choice;
      if (J > 1) {
        TopkArgs tk;
        tk.logits = row;
        tk.dtype = dtype;
        tk.rows = 1;
        tk.vocab = V;
        tk.row_stride = V;
        tk.k = std::min(J, V);
        tk.tokens = top.data();
        tk.values = top_p.data();
        tk.num_threads = 1;
        topk_cpu(tk);
        std::int64_t n = 1;
        for (std::int64_t t = 0; t < tk.k && n < J; ++t) {
          if (top[t] != choice) cand[n++] = top[t];
        }
        for (; n < J; ++n) cand[n] = choice;  // V < J: unreachable through the engine (J <= V)
      }
      for (std::int64_t j = 0; j < J; ++j) cand_logp[j] = cand[j] < 0 ? nan : element(row, dtype, cand[j]) / 1.0f - lse;
    }
  };
  cpu::parallel_rows(slots, V, a.num_threads, body);
  w.header[3] = 2;  // scored: advance may run
}

bool selfspec_advance_cpu(const SelfSpecAdvanceArgs& a) {
  const SelfSpecGraph& g = a.graph;
  const SelfSpecState& st = a.state;
  const std::int64_t A = a.rows, bs = a.block_size, M = g.nodes, I = g.max_rank, J = a.big_j, V = a.vocab;
  const std::int64_t seg = a.copies + (a.need_next ? 1 : 0);
  Ws w = views(a.workspace, selfspec_layout(A, bs, M, J));
  const std::int64_t host_cols = 2 * bs + 4;
  bool any_commit = false;
  for (std::int64_t r = 0; r < A; ++r) {
    const bool known = st.known[r] != 0;
    const std::int64_t* node_copy = w.node_copy + r * M;
    const std::uint8_t* kept = w.kept + r * M;
    const std::uint8_t* complete = w.complete + r * M;
    // a copy's step: its most confident masked slot (first maximum; -1 where not masked)
    auto conf_at = [&](std::int64_t k) { return w.copy_masked[k] ? a.conf[k] : -1.0f; };
    auto step = [&](std::int64_t c, std::int64_t& slot, std::int64_t& tok) {
      const std::int64_t k0 = (r * seg + c) * bs;
      slot = 0;
      float best = conf_at(k0);
      for (std::int64_t s = 1; s < bs; ++s) {
        if (conf_at(k0 + s) > best) {
          best = conf_at(k0 + s);
          slot = s;
        }
      }
      tok = w.choice[k0 + slot];
    };
    // walk the graph from the root along the real steps
    std::int64_t u = 0;
    for (std::int64_t d = 0; d < g.depth && known; ++d) {
      if (complete[u]) break;
      std::int64_t slot, tok;
      step(std::max<std::int64_t>(node_copy[u], 0), slot, tok);
      const std::int64_t i = w.rank[r * bs + slot];
      std::int64_t j = -1;
      for (std::int64_t jj = 0; jj < J; ++jj) {
        if (st.cand[(r * bs + slot) * J + jj] == tok) {
          j = jj;
          break;
        }
      }
      if (i >= I || j < 0 || j >= g.cands) break;
      const std::int64_t nxt = g.next_node[(u * I + i) * g.cands + j];
      if (nxt < 0 || !kept[nxt]) break;
      u = nxt;
    }
    const std::int64_t final_copy = node_copy[u];
    const bool done_block = complete[u] != 0;
    const bool went_next = done_block && u == w.anchor[r] && w.has_anchor[r];
    const std::int64_t steps = known ? g.size[u] : 0;
    const std::int64_t src = went_next ? a.copies : std::max<std::int64_t>(final_copy, 0);
    const std::int64_t commit_copy = std::max<std::int64_t>(final_copy, 0);
    const std::int64_t* node_tok = w.node_tokens + (r * M + u) * bs;
    const std::uint8_t* node_msk = w.node_masked + (r * M + u) * bs;
    std::int64_t* host = a.host + r * host_cols;
    std::int64_t new_masked_count = 0;
    for (std::int64_t s = 0; s < bs; ++s) {
      const std::int64_t k = (r * seg + src) * bs + s;
      const std::int64_t tok = done_block ? a.mask_id : node_tok[s];
      const bool msk = done_block || node_msk[s];
      const std::int64_t choice = w.choice[k];
      a.new_tokens[r * bs + s] = tok;
      a.new_masked[r * bs + s] = msk;
      a.new_choice[r * bs + s] = choice;
      a.new_conf[r * bs + s] = msk ? conf_at(k) : -1.0f;
      std::memcpy(a.new_cand + (r * bs + s) * J, w.cand + k * J, static_cast<std::size_t>(J) * 8);
      std::memcpy(a.new_cand_logp + (r * bs + s) * J, w.cand_logp + k * J, static_cast<std::size_t>(J) * 4);
      host[2 + s] = node_tok[s];              // the block as the walk left it
      host[bs + 4 + s] = msk ? choice : tok;  // filled by the choices (greedy last step)
      a.keep[r * bs + s] = done_block ? commit_copy * bs + s : -1;
      new_masked_count += msk;
    }
    const bool new_known = !done_block || went_next;
    host[0] = done_block;
    host[1] = steps;
    host[bs + 2] = w.num_kept[r];
    host[bs + 3] = new_known && new_masked_count == 1;
    a.new_known[r] = new_known;
    if (done_block) {
      any_commit = true;
      const void* last = row_at(a.logits, a.dtype, ((r * seg + commit_copy) * bs + bs - 1) * a.row_stride);
      for (std::int64_t v = 0; v < V; ++v) a.carry[r * V + v] = element(last, a.dtype, v);
    }
  }
  w.header[3] = 3;  // advanced: the next round expands
  return any_commit;
}

}  // namespace dspec
