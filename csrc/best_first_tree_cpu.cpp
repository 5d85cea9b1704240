// best_first_tree on the CPU (best_first_tree.h): per request, each slot's candidates ranked
// by factor (descending, ties to the lower candidate index), then N pops of a binary heap
// whose entries carry their push sequence number, the tie rule every backend shares.
//
// Sequence numbers: the seed is 0; the i-th pop pushes its sibling as 1 + 2 i and its child
// as 2 + 2 i (absent pushes leave their numbers unused), so "pushed first" is "lower number"
// -- the torch reference's frontier column.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "best_first_tree.h"
#include "dtype.h"

namespace dspec {
namespace {

struct Entry {
  float score;
  float parent_score;
  std::int64_t seq;
  std::int64_t depth;   // slot index, 0-based
  std::int64_t rank;    // rank of the candidate within its slot
  std::int64_t parent;  // -1: the root
};

// std::push_heap / pop_heap keep the "largest" on top: higher score, then lower seq.
bool below(const Entry& a, const Entry& b) { return a.score < b.score || (a.score == b.score && a.seq > b.seq); }

float factor(float p) {
  return p > 0.0f ? (p < 1.0f ? p : 1.0f) : 0.0f;  // NaN fails p > 0: 0
}

std::int64_t load_id(const void* base, int dtype, std::int64_t i) {
  return dtype == kInt32 ? static_cast<std::int64_t>(static_cast<const std::int32_t*>(base)[i])
                         : static_cast<const std::int64_t*>(base)[i];
}

}  // namespace

void best_first_tree_cpu(const BestFirstTreeArgs& a) {
  const std::int64_t L = a.slots, k = a.k, n = a.nodes, lk = L * k;
  std::vector<float> raw(static_cast<std::size_t>(k)), fs(static_cast<std::size_t>(lk));
  std::vector<std::int64_t> order(static_cast<std::size_t>(k)), ts(static_cast<std::size_t>(lk));
  std::vector<Entry> heap;
  heap.reserve(static_cast<std::size_t>(1 + 2 * n));
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const std::int64_t base = b * lk;
    // each slot's factors and tokens in rank order
    for (std::int64_t d = 0; d < L; ++d) {
      for (std::int64_t c = 0; c < k; ++c)
        raw[static_cast<std::size_t>(c)] = factor(dt::load(a.probs, a.probs_dtype, base + d * k + c));
      std::iota(order.begin(), order.end(), std::int64_t{0});
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) {
        return raw[static_cast<std::size_t>(x)] > raw[static_cast<std::size_t>(y)];
      });
      for (std::int64_t r = 0; r < k; ++r) {
        const std::int64_t c = order[static_cast<std::size_t>(r)];
        fs[static_cast<std::size_t>(d * k + r)] = raw[static_cast<std::size_t>(c)];
        ts[static_cast<std::size_t>(d * k + r)] = load_id(a.tokens, a.tokens_dtype, base + d * k + c);
      }
    }
    heap.clear();
    heap.push_back({1.0f * fs[0], 1.0f, 0, 0, 0, -1});
    std::int64_t* tok = a.out_tokens + b * n;
    std::int64_t* par = a.out_parents + b * n;
    float* score = a.out_scores + b * n;
    std::int64_t* depth = a.out_depth + b * n;
    // n <= the number of paths and every path is reachable: the heap never runs dry first
    for (std::int64_t i = 0; i < n; ++i) {
      std::pop_heap(heap.begin(), heap.end(), below);
      const Entry e = heap.back();
      heap.pop_back();
      tok[i] = ts[static_cast<std::size_t>(e.depth * k + e.rank)];
      par[i] = e.parent;
      score[i] = e.score;
      depth[i] = e.depth + 1;
      if (e.rank + 1 < k) {  // the next-best sibling: same parent, next rank
        heap.push_back({e.parent_score * fs[static_cast<std::size_t>(e.depth * k + e.rank + 1)], e.parent_score,
                        1 + 2 * i, e.depth, e.rank + 1, e.parent});
        std::push_heap(heap.begin(), heap.end(), below);
      }
      if (e.depth + 1 < L) {  // the best child: next slot's best candidate
        heap.push_back(
            {e.score * fs[static_cast<std::size_t>((e.depth + 1) * k)], e.score, 2 + 2 * i, e.depth + 1, 0, i});
        std::push_heap(heap.begin(), heap.end(), below);
      }
    }
  }
}

}  // namespace dspec
