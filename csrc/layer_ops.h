// Element-wise pieces of a transformer layer on the CPU, fused so that one decode step
// pays one call per piece instead of a handful of torch ops: RMSNorm and rotate-half RoPE
// on q and k together.  Math in float32; results
// rounded to the tensors' dtype exactly as dspec/models/transformer.py's torch code
// rounds them (the tests compare the two).
#pragma once

#include <cstdint>

#include "dspec.h"

namespace dspec {

struct RmsNormArgs {
  int dtype = kFloat32;  // x, weight, out
  std::int64_t rows = 0;
  std::int64_t hidden = 0;
  float eps = 1e-6f;
  const void* x = nullptr;       // [rows, hidden] contiguous
  const void* weight = nullptr;  // [hidden]
  void* out = nullptr;           // [rows, hidden] contiguous
  int num_threads = 1;
};

// Elements of work per thread of RMSNorm, RoPE and the decoder's residual add: from ~16
// rows of a 576-wide model on they take the pool (whose workers spin between the kernels
// of a forward, so a hand-off costs a few microseconds) instead of leaving it idle.
constexpr std::int64_t kLayerOpElementsPerThread = std::int64_t(1) << 13;

// out = weight * rmsnorm(x)
void rms_norm_cpu(const RmsNormArgs& args);

// RoPE rotates a head through a stack buffer of this many floats: the largest head_dim.
constexpr std::int64_t kRopeMaxHeadDim = 1024;

struct RopeArgs {
  int dtype = kFloat32;   // q, k (rotated in place)
  std::int64_t rows = 0;  // B * N token rows
  std::int64_t hq = 0, hkv = 0, head_dim = 0;
  void* q = nullptr;           // [rows, hq, D] contiguous
  void* k = nullptr;           // [rows, hkv, D] contiguous
  const float* cos = nullptr;  // [rows, D] float32
  const float* sin = nullptr;  // [rows, D] float32, signed: (-sin, +sin) over the halves
  int num_threads = 1;
};

// x = x * cos + (x2, x1) * signed_sin per head, for q and k
void rope_cpu(const RopeArgs& args);

// The KV cache's row moves (commit of accepted suffix rows, growth, batch selection):
// rows of row_bytes bytes, in `groups` groups (layers, or layers x requests) at fixed byte
// strides.  torch's index_copy_ / strided copy_ open an OpenMP team for a few hundred KB,
// whose worker then spins on the cores the decoder's pool needs; this stays on the calling
// thread up to a few MB.
struct CopyRowsArgs {
  const char* src = nullptr;  // group g, row r at src + g * src_group_stride + r * row_bytes
  char* dst = nullptr;        // likewise with dst_group_stride
  std::int64_t groups = 0;
  std::int64_t src_group_stride = 0, dst_group_stride = 0;  // bytes
  std::int64_t rows = 0;                                    // rows moved per group
  const std::int64_t* src_rows = nullptr;                   // [rows] row indices within a source group
  const std::int64_t* dst_rows = nullptr;                   // [rows] row indices within a destination group
  std::int64_t row_bytes = 0;
  int num_threads = 1;
};

// dst row dst_rows[i] = src row src_rows[i] in every group (no two dst_rows equal)
void copy_rows_cpu(const CopyRowsArgs& args);

}  // namespace dspec
