// best_first_tree: DDTree's best-first draft tree over a block drafter's per-slot candidates
// (dspec/reference/best_first_tree.py is the reference; dspec.best_first_tree the public op).
//
// A node is a path (c_1 .. c_d), d <= slots, taking candidate c_j at slot j; its score is the
// float32 product parent score * factor, factor = the candidate's probability clamped to
// [0, 1] (NaN counts as 0), the root's score 1.  The N best nodes come out in the pop order
// of a max-heap seeded with slot 0's best candidate, where popping a node pushes its
// next-best sibling, then its best child; equal scores pop in push order.
#pragma once

#include <cstdint>

#include "dspec.h"  // dtype codes

namespace dspec {

struct BestFirstTreeArgs {
  const void* probs = nullptr;  // batch x slots x k, contiguous; float32 / float16 / bfloat16
  int probs_dtype = kFloat32;
  const void* tokens = nullptr;  // batch x slots x k, contiguous; int32 / int64
  int tokens_dtype = kInt64;
  std::int64_t batch = 0;
  std::int64_t slots = 0;
  std::int64_t k = 0;
  std::int64_t nodes = 0;  // N <= the number of paths: nodes emitted per request
  // outputs, each batch x nodes, contiguous, in pop order
  std::int64_t* out_tokens = nullptr;
  std::int64_t* out_parents = nullptr;  // -1: a child of the root, else an earlier node's index
  float* out_scores = nullptr;
  std::int64_t* out_depth = nullptr;  // 1 .. slots
};

void best_first_tree_cpu(const BestFirstTreeArgs& args);

}  // namespace dspec
