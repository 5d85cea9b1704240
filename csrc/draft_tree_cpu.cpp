// draft_tree on the CPU: the best N draft paths over a block drafter's per-slot candidates,
// pruned by cost, rooted at the anchor, with positions and the ancestor mask -- one call for
// what the torch composition (marginal_tree, best_count, three concatenations, tree_mask:
// ~45 small ops, ~0.6 ms a cycle right after a verification forward has streamed the
// weights through the caches) computes.
//
// A node is a path (c_1 .. c_d) over slots 1 .. d, its score prod_j p[j][c_j] (double, each
// factor clamped to [0, 1], so a score never rises along a path).  A beam of N per depth
// finds the best N exactly: a child's score is its parent's times a factor of its own slot.
// Order of the result: score descending; ties by depth (shallower first), then by the order
// within the depth (the beam's: score descending, then (parent rank, candidate) ascending) --
// the reference's stable sort over its depth-major list (its topk breaks ties its own way:
// results may differ only where scores tie exactly).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "masks.h"

namespace dspec {
namespace {

struct Cand {
  double score;
  std::int64_t flat;  // parent beam index * k + candidate
};

// Best n (value descending, flat ascending on ties) of cands, in that order.
void keep_best(std::vector<Cand>& cands, std::int64_t n) {
  auto better = [](const Cand& a, const Cand& b) {
    return a.score > b.score || (a.score == b.score && a.flat < b.flat);
  };
  if (static_cast<std::int64_t>(cands.size()) > n) {
    std::partial_sort(cands.begin(), cands.begin() + n, cands.end(), better);
    cands.resize(static_cast<std::size_t>(n));
  } else {
    std::sort(cands.begin(), cands.end(), better);
  }
}

}  // namespace

std::int64_t draft_tree_cpu(const DraftTreeArgs& a) {
  const std::int64_t L = a.slots, k = a.k, cap = a.capacity;
  std::vector<std::int64_t> kept_count(static_cast<std::size_t>(a.batch), 0);
  // per request: the kept nodes in final order (level, index in level) and their data
  struct Node {
    double score;
    std::int64_t level, index, token, parent_level_index;
  };
  std::vector<std::vector<Node>> trees(static_cast<std::size_t>(a.batch));
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const float* p = a.probs + b * L * k;
    const std::int64_t* t = a.tokens + b * L * k;
    std::vector<Node> all;
    std::vector<double> prev(1, 1.0);
    std::vector<Cand> cands;
    for (std::int64_t d = 0; d < L; ++d) {
      cands.clear();
      for (std::size_t i = 0; i < prev.size(); ++i) {
        for (std::int64_t c = 0; c < k; ++c) {
          double f = static_cast<double>(p[d * k + c]);
          f = f < 0.0 ? 0.0 : (f > 1.0 ? 1.0 : f);  // no NaN: the binding rejects it
          cands.push_back({prev[i] * f, static_cast<std::int64_t>(i) * k + c});
        }
      }
      keep_best(cands, std::min<std::int64_t>(a.nodes, static_cast<std::int64_t>(cands.size())));
      prev.resize(cands.size());
      for (std::size_t j = 0; j < cands.size(); ++j) {
        prev[j] = cands[j].score;
        all.push_back(
            {cands[j].score, d, static_cast<std::int64_t>(j), t[d * k + cands[j].flat % k], cands[j].flat / k});
      }
    }
    // depth-major list, stable by score descending: the first cap nodes
    std::stable_sort(all.begin(), all.end(), [](const Node& x, const Node& y) { return x.score > y.score; });
    all.resize(static_cast<std::size_t>(std::min<std::int64_t>(cap, static_cast<std::int64_t>(all.size()))));
    std::int64_t n = static_cast<std::int64_t>(all.size());
    if (a.row_cost >= 0.0) {
      // best_count: the first n maximising (1 + sum of float32 scores) / (1 + row_cost n)
      // (the reference's order of operations: cumsum, then + 1)
      double sum = 0.0, best = -1.0;
      std::int64_t arg = 1;
      for (std::int64_t j = 0; j < n; ++j) {
        sum += static_cast<double>(static_cast<float>(all[static_cast<std::size_t>(j)].score));
        const double v = (sum + 1.0) / (1.0 + a.row_cost * static_cast<double>(j + 1));
        if (v > best) {
          best = v;
          arg = j + 1;
        }
      }
      n = arg;
    }
    kept_count[static_cast<std::size_t>(b)] = n;
    trees[static_cast<std::size_t>(b)] = std::move(all);
  }
  std::int64_t n = a.row_cost >= 0.0 ? *std::max_element(kept_count.begin(), kept_count.end()) : cap;
  const std::int64_t cols = 1 + n, words = mask_words(cols), out_cols = 1 + cap;
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const std::vector<Node>& all = trees[static_cast<std::size_t>(b)];
    std::int64_t* tok = a.out_tokens + b * out_cols;
    std::int64_t* par = a.out_parents + b * out_cols;
    std::int64_t* pos = a.out_positions + b * out_cols;
    // column of (level, index in level): the columns of the level above, looked up
    std::vector<std::vector<std::int64_t>> column(static_cast<std::size_t>(L));
    for (std::int64_t j = 0; j < static_cast<std::int64_t>(all.size()); ++j) {
      auto& col = column[static_cast<std::size_t>(all[static_cast<std::size_t>(j)].level)];
      const std::int64_t at = all[static_cast<std::size_t>(j)].index;
      if (static_cast<std::int64_t>(col.size()) <= at) col.resize(static_cast<std::size_t>(at + 1), -1);
      col[static_cast<std::size_t>(at)] = 1 + j;
    }
    tok[0] = a.root_tokens[b];
    par[0] = -1;
    pos[0] = a.root_positions[b];
    for (std::int64_t j = 0; j < cap; ++j) {
      const Node& x = all[static_cast<std::size_t>(j)];
      tok[1 + j] = x.token;
      // a kept node's parent ranks before it (its score is at least the child's, and on a
      // tie the shallower comes first), so it is kept too
      par[1 + j] = x.level == 0
                       ? 0
                       : column[static_cast<std::size_t>(x.level - 1)][static_cast<std::size_t>(x.parent_level_index)];
      pos[1 + j] = a.root_positions[b] + x.level + 1;
    }
    // ancestor words of the first 1 + n columns, [1 + n, words] per request
    std::int32_t* w = a.words + b * cols * words;
    for (std::int64_t i = 0; i < cols; ++i) {
      std::int32_t* row = w + i * words;
      if (i == 0) {
        std::memset(row, 0, static_cast<std::size_t>(words) * sizeof(std::int32_t));
      } else {
        std::memcpy(row, w + par[i] * words, static_cast<std::size_t>(words) * sizeof(std::int32_t));
      }
      row[i >> 5] = static_cast<std::int32_t>(static_cast<std::uint32_t>(row[i >> 5]) | (1u << (i & 31)));
    }
  }
  return n;
}

}  // namespace dspec
