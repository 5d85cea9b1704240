// Kernel launches of the .cu files: stream handles, launch-error checks, and the launch
// macro that lets tests/cuda_sim compile every .cu file (token_stats, merge_states, verify,
// pack_mask, tree_mask) as plain C++ with its host simulator of blocks, warps, shuffles, ballots and barriers
// (DSPEC_CUDA_SIM), so the kernels and launchers run without a GPU.
#pragma once

#if defined(DSPEC_CUDA_SIM)
#include "cuda_sim.h"
#define DSPEC_LAUNCH(kernel, grid, block, stream, ...) ::dspec_sim::launch((grid), (block), kernel, __VA_ARGS__)
#else
#include <cuda_runtime.h>
#define DSPEC_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dspec {

// A cudaStream_t passed from Python as an integer.
inline cudaStream_t as_stream(std::int64_t handle) {
  return reinterpret_cast<cudaStream_t>(static_cast<std::intptr_t>(handle));
}

// Throws std::runtime_error("dspec._C.<op>: CUDA launch [of <what>] failed: <error>") when the
// last launch failed.
inline void check_launch(const char* op, const char* what = nullptr) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return;
  std::string msg = std::string("dspec._C.") + op + ": CUDA launch ";
  if (what != nullptr) msg += std::string("of ") + what + " ";
  throw std::runtime_error(msg + "failed: " + cudaGetErrorString(err));
}

}  // namespace dspec
