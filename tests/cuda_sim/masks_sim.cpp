// csrc/pack_mask.cu and csrc/tree_mask.cu (kernels and launchers) compiled for the host
// simulator (cuda_sim.h), with a C interface for ctypes (tests/test_pack_mask.py,
// tests/test_tree_mask.py).
#define DSPEC_CUDA_SIM 1
#define DSPEC_MASKS_MAX_BLOCKS 3  // a small grid: the grid-stride loops take several trips
#include "cuda_sim.h"

#include <cstdio>
#include <exception>

#include "pack_mask.cu"
#include "tree_mask.cu"

namespace {

int report(const std::exception& e, char* err, int errlen) {
  std::snprintf(err, static_cast<std::size_t>(errlen), "%s", e.what());
  return 1;
}

}  // namespace

extern "C" {

int dspec_sim_pack_mask(const void* mask, std::int64_t rows, std::int64_t num_keys, std::int64_t row_stride,
                        void* words, char* err, int errlen) {
  try {
    dspec::PackMaskArgs a;
    a.mask = static_cast<const std::uint8_t*>(mask);
    a.rows = rows;
    a.num_keys = num_keys;
    a.row_stride = row_stride;
    a.words = static_cast<std::int32_t*>(words);
    dspec::pack_mask_cuda(a, 0);
    return 0;
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
}

int dspec_sim_unpack_mask(const void* words, std::int64_t rows, std::int64_t num_words, std::int64_t row_stride,
                          std::int64_t num_keys, void* out, char* err, int errlen) {
  try {
    dspec::UnpackMaskArgs a;
    a.words = static_cast<const std::int32_t*>(words);
    a.rows = rows;
    a.num_words = num_words;
    a.row_stride = row_stride;
    a.num_keys = num_keys;
    a.out = static_cast<std::uint8_t*>(out);
    dspec::unpack_mask_cuda(a, 0);
    return 0;
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
}

int dspec_sim_tree_mask(const void* parents, int dtype, std::int64_t batch, std::int64_t nodes, std::int64_t row_stride,
                        void* words, void* depth, char* err, int errlen) {
  try {
    dspec::TreeMaskArgs a;
    a.parents = parents;
    a.dtype = dtype;
    a.batch = batch;
    a.nodes = nodes;
    a.row_stride = row_stride;
    a.words = static_cast<std::int32_t*>(words);
    a.depth = static_cast<std::int64_t*>(depth);
    dspec::tree_mask_cuda(a, 0);
    return 0;
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
}

}  // extern "C"
