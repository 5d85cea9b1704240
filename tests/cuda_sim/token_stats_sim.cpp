// csrc/token_stats.cu (token_stats_kernel, token_stats_merge_kernel and the launcher
// token_stats_cuda) compiled for the host simulator (cuda_sim.h), with a C interface for
// ctypes (tests/test_cuda_sim.py).
#define DSPEC_CUDA_SIM 1
#include "cuda_sim.h"

#include <cstdio>
#include <exception>

#include "token_stats.cu"

namespace {

int report(const std::exception& e, char* err, int errlen) {
  std::snprintf(err, static_cast<std::size_t>(errlen), "%s", e.what());
  return 1;
}

}  // namespace

extern "C" {

std::int64_t dspec_sim_token_stats_workspace_bytes(std::int64_t rows, std::int64_t num_splits) {
  return dspec::token_stats_workspace_bytes(rows, num_splits);
}

// Arguments as dspec._C.token_stats (not validated here: the caller passes valid ones).
int dspec_sim_token_stats(const void* logits, int dtype, std::int64_t rows, std::int64_t vocab, std::int64_t row_stride,
                          float inv_t, std::int64_t* token, float* prob, float* margin, float* entropy, float* lse,
                          std::int64_t num_splits, void* workspace, char* err, int errlen) {
  try {
    dspec::TokenStatsArgs a;
    a.logits = logits;
    a.dtype = dtype;
    a.rows = rows;
    a.vocab = vocab;
    a.row_stride = row_stride;
    a.inv_t = inv_t;
    a.token = token;
    a.prob = prob;
    a.margin = margin;
    a.entropy = entropy;
    a.lse = lse;
    a.num_splits = num_splits;
    a.workspace = workspace;
    dspec::token_stats_cuda(a, 0);
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
  return 0;
}

}  // extern "C"
