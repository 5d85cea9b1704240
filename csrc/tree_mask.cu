// tree_mask CUDA kernel: ancestor bitsets and depths by pointer jumping, one block per tree.
//
// Thread i owns node i (nodes <= 256, so a whole tree fits one block).  Shared memory holds
// two copies (double buffering) of anc[node][word] (uint32), jump[node] and depth[node];
// round r reads copy r % 2 and writes the other, so every node reads its jump target's
// state from the same round:
//   anc[i] |= anc[jump[i]];  depth[i] += depth[jump[i]];  jump[i] = jump[jump[i]]
// for every node whose jump is not -1.  anc[i] covers the path from i up to (excluding)
// jump[i]; bit_length(nodes - 1) rounds reach every root.  A parent outside [0, i) counts
// as -1 (the kernel never reads out of bounds whatever the values).  Words are written
// back coalesced (consecutive threads, consecutive words).
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

constexpr int kMaxNodes = kTreeMaskMaxNodes;
constexpr int kMaxWords = kTreeMaskMaxWords;

template <typename IdxT>
__global__ void __launch_bounds__(kMaxNodes)
    tree_mask_kernel(const IdxT* __restrict__ parents, std::int64_t row_stride, int nodes, int num_words, int rounds,
                     std::int32_t* __restrict__ words, std::int64_t* __restrict__ depth) {
  __shared__ std::uint32_t anc[2][kMaxNodes][kMaxWords];
  __shared__ int jump[2][kMaxNodes];
  __shared__ int dep[2][kMaxNodes];
  const std::int64_t b = blockIdx.x;
  const int i = threadIdx.x;
  if (i < nodes) {
    const std::int64_t p = static_cast<std::int64_t>(parents[b * row_stride + i]);
    const int j = (p >= 0 && p < i) ? static_cast<int>(p) : -1;
    jump[0][i] = j;
    dep[0][i] = j >= 0 ? 1 : 0;
    for (int w = 0; w < num_words; ++w) anc[0][i][w] = w == (i >> 5) ? (1u << (i & 31)) : 0u;
  }
  __syncthreads();
  int cur = 0;
  for (int r = 0; r < rounds; ++r) {
    const int nxt = cur ^ 1;
    if (i < nodes) {
      const int j = jump[cur][i];
      if (j >= 0) {
        for (int w = 0; w < num_words; ++w) anc[nxt][i][w] = anc[cur][i][w] | anc[cur][j][w];
        dep[nxt][i] = dep[cur][i] + dep[cur][j];
        jump[nxt][i] = jump[cur][j];
      } else {
        for (int w = 0; w < num_words; ++w) anc[nxt][i][w] = anc[cur][i][w];
        dep[nxt][i] = dep[cur][i];
        jump[nxt][i] = -1;
      }
    }
    __syncthreads();
    cur = nxt;
  }
  std::int32_t* out = words + b * nodes * num_words;
  for (int t = i; t < nodes * num_words; t += blockDim.x) {
    const int n = t / num_words;
    out[t] = static_cast<std::int32_t>(anc[cur][n][t - n * num_words]);
  }
  if (i < nodes) depth[b * nodes + i] = dep[cur][i];
}

}  // namespace

void tree_mask_cuda(const TreeMaskArgs& a, std::int64_t stream_handle) {
  if (a.batch <= 0 || a.nodes <= 0) return;
  if (a.nodes > kMaxNodes) throw std::invalid_argument("dspec._C.tree_mask: nodes must be <= 256 on CUDA");
  const cudaStream_t stream = as_stream(stream_handle);
  const int nodes = static_cast<int>(a.nodes);
  const int num_words = static_cast<int>(mask_words(a.nodes));
  int rounds = 0;
  while ((1 << rounds) < nodes) ++rounds;  // bit_length(nodes - 1)
  const int threads = ((nodes + 31) / 32) * 32;
  const unsigned grid = static_cast<unsigned>(a.batch);
  if (a.dtype == kIndexInt32) {
    DSPEC_LAUNCH(tree_mask_kernel<std::int32_t>, grid, threads, stream, static_cast<const std::int32_t*>(a.parents),
                 a.row_stride, nodes, num_words, rounds, a.words, a.depth);
  } else {
    DSPEC_LAUNCH(tree_mask_kernel<std::int64_t>, grid, threads, stream, static_cast<const std::int64_t*>(a.parents),
                 a.row_stride, nodes, num_words, rounds, a.words, a.depth);
  }
  check_launch("tree_mask");
}

}  // namespace dspec
