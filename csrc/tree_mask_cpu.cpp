// tree_mask on the CPU.  Parents precede their children (parent < i), so one pass in index
// order gives every node its ancestors: anc[i] = anc[parent] | {i}, depth = depth[parent] + 1
// (O(N W) per tree, against O(N W log N) for the GPU's pointer jumping, with identical
// results: a parent outside [0, i) counts as -1 in both).
#include <cstdint>
#include <cstring>

#include "masks.h"

namespace dspec {
namespace {

template <typename IdxT>
void run(const TreeMaskArgs& a) {
  const IdxT* parents = static_cast<const IdxT*>(a.parents);
  const std::int64_t n = a.nodes;
  const std::int64_t num_words = mask_words(n);
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const IdxT* par = parents + b * a.row_stride;
    std::int32_t* words = a.words + b * n * num_words;
    std::int64_t* depth = a.depth + b * n;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t p = static_cast<std::int64_t>(par[i]);
      std::int32_t* row = words + i * num_words;
      if (p >= 0 && p < i) {
        std::memcpy(row, words + p * num_words, static_cast<std::size_t>(num_words) * sizeof(std::int32_t));
        depth[i] = depth[p] + 1;
      } else {
        std::memset(row, 0, static_cast<std::size_t>(num_words) * sizeof(std::int32_t));
        depth[i] = 0;
      }
      row[i >> 5] = static_cast<std::int32_t>(static_cast<std::uint32_t>(row[i >> 5]) | (1u << (i & 31)));
    }
  }
}

}  // namespace

void tree_mask_cpu(const TreeMaskArgs& a) {
  if (a.dtype == kIndexInt32) {
    run<std::int32_t>(a);
  } else {
    run<std::int64_t>(a);
  }
}

}  // namespace dspec
