// dspec._C masks: pack_mask / unpack_mask / tree_mask launchers shared by the C++ CPU code
// (pack_mask_cpu.cpp, tree_mask_cpu.cpp), the CUDA kernels (pack_mask.cu, tree_mask.cu)
// and the bindings (masks_bindings.cpp).  Plain C++17: no CUDA, no pybind11 header.
//
// Layout (dspec/reference/pack_mask.py): words[row, w] holds keys 32 w .. 32 w + 31 of a
// row, bit j (1u << j; as int32, bit 31 is the sign bit) is key 32 w + j; bits past the
// last key are 0.  Masks are one byte per key (torch.bool: 0 or 1; any non-zero is set).
//
// Every function assumes arguments validated by masks_bindings.cpp.  The CUDA ones launch
// on `stream` (a cudaStream_t as an integer) on the current device and throw
// std::runtime_error when a launch fails; they are defined only when built with CUDA.
#pragma once

#include <cstdint>

namespace dspec {

// dtype codes of index tensors (tree parents).
enum IndexDTypeCode : int { kIndexInt32 = 0, kIndexInt64 = 1 };

// tree_mask's CUDA kernel keeps a whole tree in one block's shared memory.
constexpr int kTreeMaskMaxNodes = 256;
constexpr int kTreeMaskMaxWords = kTreeMaskMaxNodes / 32;

inline std::int64_t mask_words(std::int64_t num_keys) { return (num_keys + 31) / 32; }

struct PackMaskArgs {
  const std::uint8_t* mask = nullptr;  // rows x num_keys bytes, row_stride bytes between rows
  std::int64_t rows = 0;
  std::int64_t num_keys = 0;
  std::int64_t row_stride = 0;
  std::int32_t* words = nullptr;  // rows x mask_words(num_keys), contiguous
};

struct UnpackMaskArgs {
  const std::int32_t* words = nullptr;  // rows x num_words, row_stride elements between rows
  std::int64_t rows = 0;
  std::int64_t num_words = 0;
  std::int64_t row_stride = 0;
  std::int64_t num_keys = 0;    // <= 32 * num_words; later bits are ignored
  std::uint8_t* out = nullptr;  // rows x num_keys bytes (0 / 1), contiguous
};

struct TreeMaskArgs {
  const void* parents = nullptr;  // batch x nodes, int32 or int64, row_stride elements between rows
  int dtype = kIndexInt64;
  std::int64_t batch = 0;
  std::int64_t nodes = 0;
  std::int64_t row_stride = 0;
  std::int32_t* words = nullptr;  // batch x nodes x mask_words(nodes), contiguous
  std::int64_t* depth = nullptr;  // batch x nodes, contiguous
};

// draft_tree (CPU only): a block drafter's per-slot candidates -> the best draft tree, rooted
// at each request's anchor, with its positions and ancestor mask (dspec/decode/dflash.py's
// draft_tree; the torch composition there is the reference).
struct DraftTreeArgs {
  const float* probs = nullptr;                  // batch x slots x k, contiguous: candidate probabilities
  const std::int64_t* tokens = nullptr;          // batch x slots x k, contiguous: candidate ids
  const std::int64_t* root_tokens = nullptr;     // batch: the anchors
  const std::int64_t* root_positions = nullptr;  // batch: the anchors' positions
  std::int64_t batch = 0;
  std::int64_t slots = 0;
  std::int64_t k = 0;
  std::int64_t nodes = 0;     // N >= 1: nodes kept at most (besides the root)
  double row_cost = -1.0;     // >= 0: prune to the best count per cost (best_count); < 0: none
  std::int64_t capacity = 0;  // N' = min(N, number of paths): the outputs' node columns
  // outputs, each batch x (1 + capacity) (node 0 the root), contiguous; the first 1 + n
  // columns hold the tree, n = the returned count; words batch x (1 + n) x mask_words(1 + n)
  std::int64_t* out_tokens = nullptr;
  std::int64_t* out_parents = nullptr;
  std::int64_t* out_positions = nullptr;
  std::int32_t* words = nullptr;  // room for batch x (1 + capacity) x mask_words(1 + capacity)
};

// Returns n, the nodes kept per request (the largest over the batch with row_cost).
std::int64_t draft_tree_cpu(const DraftTreeArgs& args);

void pack_mask_cpu(const PackMaskArgs& args);
void unpack_mask_cpu(const UnpackMaskArgs& args);
// Ancestors in one pass over the nodes in index order (parents precede children); a parent
// outside [0, i) counts as -1, as in every other backend.
void tree_mask_cpu(const TreeMaskArgs& args);

void pack_mask_cuda(const PackMaskArgs& args, std::int64_t stream);
void unpack_mask_cuda(const UnpackMaskArgs& args, std::int64_t stream);
// nodes <= kTreeMaskMaxNodes; pointer jumping, one block per tree.
void tree_mask_cuda(const TreeMaskArgs& args, std::int64_t stream);

}  // namespace dspec
