// merge_states: combine two partial attention states (o, lse) over disjoint key sets.
//   o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b}),  lse = log of the sum;
//   two empty states (lse = -inf) give o = 0, lse = -inf.
// The per-element math is here once, for the CPU loop and the CUDA kernel alike.
#pragma once

#include <cmath>
#include <cstdint>

#include "dspec.h"

namespace dspec {

struct MergeStatesArgs {
  const void* o_a = nullptr;     // [rows, head_dim], dtype
  const float* lse_a = nullptr;  // [rows]
  const void* o_b = nullptr;
  const float* lse_b = nullptr;
  void* out = nullptr;       // [rows, head_dim], dtype
  float* lse_out = nullptr;  // [rows]
  int dtype = kFloat32;
  std::int64_t rows = 0;
  std::int64_t head_dim = 0;  // >= 0 (0: only the lse is merged)
  int num_threads = 1;        // CPU: at most this many threads (the caller's count)
};

void merge_states_cpu(const MergeStatesArgs& args);
void merge_states_cuda(const MergeStatesArgs& args, std::int64_t stream);

namespace ms {

struct Weights {
  float wa, wb, inv_total, lse;
};

DSPEC_HD Weights weights(float la, float lb) {
  // a NaN lse propagates (fmaxf would drop it), as torch.maximum does in the reference
  const float m = (la != la || lb != lb) ? NAN : fmaxf(la, lb);
  const bool empty = m == -INFINITY;
  const float m_safe = empty ? 0.0f : m;
  const float wa = expf(la - m_safe);
  const float wb = expf(lb - m_safe);
  const float total = wa + wb;
  return {wa, wb, empty ? 0.0f : 1.0f / total, empty ? m : m_safe + logf(total)};
}

}  // namespace ms
}  // namespace dspec
