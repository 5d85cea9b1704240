// merge_states on the GPU.  One thread per (row, 4 consecutive elements of D): any number of
// rows (heads x tokens) and any head dim, no per-block limit tied to the head count (unlike
// kernels that give a block one row per thread).  Each thread recomputes its row's two
// weights from the two lse values (8 bytes, cached) and streams 4 elements of o_a and o_b.
// grid.x = ceil(rows * ceil(D / 4) / 256), block = 256.
//
// DSPEC_CUDA_SIM: tests/cuda_sim/merge_states_sim.cpp compiles this file as plain C++ with
// the host simulator (tests/cuda_sim/cuda_sim.h); the kernel is launched through
// DSPEC_LAUNCH (cuda_launch.h) for that.
#include "cuda_launch.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "dtype.h"
#include "merge_states.h"

namespace dspec {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;

template <int DT>
__global__ void merge_states_kernel(MergeStatesArgs a, std::int64_t chunks_per_row) {
  const std::int64_t id = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (id >= a.rows * chunks_per_row) return;
  const std::int64_t r = id / chunks_per_row;
  const std::int64_t d0 = (id % chunks_per_row) * kVec;
  const ms::Weights w = ms::weights(a.lse_a[r], a.lse_b[r]);
  const std::int64_t base = r * a.head_dim;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const std::int64_t d = d0 + i;
    if (d < a.head_dim) {
      const float v = (w.wa * dt::load<DT>(a.o_a, base + d) + w.wb * dt::load<DT>(a.o_b, base + d)) * w.inv_total;
      dt::store<DT>(a.out, base + d, v);
    }
  }
  if (d0 == 0) a.lse_out[r] = w.lse;
}

}  // namespace

void merge_states_cuda(const MergeStatesArgs& args, std::int64_t stream) {
  const std::int64_t chunks = std::max<std::int64_t>(1, (args.head_dim + kVec - 1) / kVec);  // D = 0: lse only
  const std::int64_t blocks = (args.rows * chunks + kThreads - 1) / kThreads;
  if (blocks > 2147483647LL) throw std::invalid_argument("merge_states: rows * head_dim too large for one launch");
  const cudaStream_t s = as_stream(stream);
  const unsigned grid = static_cast<unsigned>(blocks);
  switch (args.dtype) {
    case kFloat16: DSPEC_LAUNCH(merge_states_kernel<kFloat16>, grid, kThreads, s, args, chunks); break;
    case kBFloat16: DSPEC_LAUNCH(merge_states_kernel<kBFloat16>, grid, kThreads, s, args, chunks); break;
    default: DSPEC_LAUNCH(merge_states_kernel<kFloat32>, grid, kThreads, s, args, chunks); break;
  }
  check_launch("merge_states");
}

}  // namespace dspec
