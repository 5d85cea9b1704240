// Registration of the fused layer ops (rms_norm, rope) in dspec._C; called from
// PYBIND11_MODULE in bindings.cpp.  Defined in layer_ops_bindings.cpp.
#pragma once

#include <cstdint>
#include <string>

#include "checks.h"
#include "layer_ops.h"

namespace pybind11 {
class module_;
}

namespace dspec {
void register_layer_ops(pybind11::module_& m);

// head_dim as rope_cpu takes it (even, at least 2, at most kRopeMaxHeadDim); shared with
// decoder_layers, which runs rope_cpu per layer.
inline void check_rope_head_dim(const Checker& c, std::int64_t head_dim) {
  c.at_least(head_dim, 2, "head_dim");
  if (head_dim % 2 != 0 || head_dim > kRopeMaxHeadDim) {
    c.fail("head_dim must be even and <= " + std::to_string(kRopeMaxHeadDim) + ", got " + std::to_string(head_dim));
  }
}
}  // namespace dspec
