// pack_mask / unpack_mask CUDA kernels (layout: masks.h).
//
// pack: one warp per word (grid-stride over rows x num_words): lane j reads key 32 w + j
// (32 consecutive bytes, one sector) and __ballot_sync packs the 32 predicates into the
// word, bit j = lane j, exactly the layout wanted; lane 0 stores it.
// unpack: one thread per output byte (grid-stride): (word >> (k % 32)) & 1.
//
// DSPEC_CUDA_SIM: tests/cuda_sim compiles this file as plain C++ with its host simulator of
// blocks, warps, ballots and barriers (tests/cuda_sim/masks_sim.cpp), so the kernels and
// launchers run without a GPU; kernels are launched through DSPEC_LAUNCH (cuda_launch.h).
#include "cuda_launch.h"

#include <cstdint>
#include <stdexcept>

#include "masks.h"

namespace dspec {
namespace {

constexpr int kThreads = 256;
#ifndef DSPEC_MASKS_MAX_BLOCKS
#define DSPEC_MASKS_MAX_BLOCKS 65536  // (the simulator tests use a small cap to exercise the loops)
#endif
constexpr std::int64_t kMaxBlocks = DSPEC_MASKS_MAX_BLOCKS;  // grid-stride beyond

__global__ void pack_mask_kernel(const std::uint8_t* __restrict__ mask, std::int64_t rows, std::int64_t num_keys,
                                 std::int64_t row_stride, std::int64_t num_words, std::int32_t* __restrict__ words) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  const std::int64_t total = rows * num_words;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; t < total;
       t += warps) {  // t is uniform across the warp: every lane takes the same trips
    const std::int64_t r = t / num_words;
    const std::int64_t w = t - r * num_words;
    const std::int64_t key = w * 32 + lane;
    const bool set = key < num_keys && mask[r * row_stride + key] != 0;
    const unsigned word = __ballot_sync(0xffffffffu, set);
    if (lane == 0) words[t] = static_cast<std::int32_t>(word);
  }
}

__global__ void unpack_mask_kernel(const std::int32_t* __restrict__ words, std::int64_t rows, std::int64_t row_stride,
                                   std::int64_t num_keys, std::uint8_t* __restrict__ out) {
  const std::int64_t total = rows * num_keys;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
    const std::int64_t r = t / num_keys;
    const std::int64_t k = t - r * num_keys;
    const unsigned word = static_cast<unsigned>(words[r * row_stride + (k >> 5)]);  // const __restrict__: nc loads
    out[t] = static_cast<std::uint8_t>((word >> (k & 31)) & 1u);
  }
}

unsigned blocks_for(std::int64_t work_items, std::int64_t per_block) {
  std::int64_t blocks = (work_items + per_block - 1) / per_block;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

}  // namespace

void pack_mask_cuda(const PackMaskArgs& a, std::int64_t stream_handle) {
  const std::int64_t num_words = mask_words(a.num_keys);
  if (a.rows <= 0 || num_words <= 0) return;
  const cudaStream_t stream = as_stream(stream_handle);
  DSPEC_LAUNCH(pack_mask_kernel, blocks_for(a.rows * num_words, kThreads / 32), kThreads, stream, a.mask, a.rows,
               a.num_keys, a.row_stride, num_words, a.words);
  check_launch("pack_mask");
}

void unpack_mask_cuda(const UnpackMaskArgs& a, std::int64_t stream_handle) {
  if (a.rows <= 0 || a.num_keys <= 0) return;
  const cudaStream_t stream = as_stream(stream_handle);
  DSPEC_LAUNCH(unpack_mask_kernel, blocks_for(a.rows * a.num_keys, kThreads), kThreads, stream, a.words, a.rows,
               a.row_stride, a.num_keys, a.out);
  check_launch("unpack_mask");
}

}  // namespace dspec
