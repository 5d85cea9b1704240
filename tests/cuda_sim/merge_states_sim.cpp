// csrc/merge_states.cu (merge_states_kernel and the launcher merge_states_cuda) compiled
// for the host simulator (cuda_sim.h), with a C interface for ctypes (tests/test_cuda_sim.py).
#define DSPEC_CUDA_SIM 1
#include "cuda_sim.h"

#include <cstdio>
#include <exception>

#include "merge_states.cu"

extern "C" {

// Arguments as dspec._C.merge_states (not validated here: the caller passes valid ones).
int dspec_sim_merge_states(const void* o_a, const float* lse_a, const void* o_b, const float* lse_b, void* out,
                           float* lse_out, int dtype, std::int64_t rows, std::int64_t head_dim, char* err, int errlen) {
  try {
    dspec::MergeStatesArgs a;
    a.o_a = o_a;
    a.lse_a = lse_a;
    a.o_b = o_b;
    a.lse_b = lse_b;
    a.out = out;
    a.lse_out = lse_out;
    a.dtype = dtype;
    a.rows = rows;
    a.head_dim = head_dim;
    dspec::merge_states_cuda(a, 0);
  } catch (const std::exception& e) {
    std::snprintf(err, static_cast<std::size_t>(errlen), "%s", e.what());
    return 1;
  }
  return 0;
}

}  // extern "C"
