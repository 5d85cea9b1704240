// The decoder layers of a Llama-style model for one inference forward on the CPU, in one
// call: per layer RMSNorm -> q / k / v -> RoPE -> cascade attention -> o + residual ->
// RMSNorm -> gate / up -> SiLU * up -> down + residual, with a mask-selective adapter's
// low-rank update at [MASK] rows where the model has one.
//
// A decode step runs ~15 small ops per layer; from Python each costs a dispatch that is
// comparable to its math at one token.  Here they are the same C++ kernels the per-op path
// calls (linear_group, rms_norm, rope, cascade_attention, mask_lora), in the same order
// with the same roundings, so the result is bit-identical to the per-op path
// (dspec/models/transformer.py; the tests compare the two).
#pragma once

#include <cstdint>
#include <vector>

#include "cascade_attention.h"
#include "dspec.h"

namespace dspec {

// The projections of a layer, in this order.
enum DecoderProjection : int { kProjQ = 0, kProjK, kProjV, kProjO, kProjGate, kProjUp, kProjDown, kProjCount };

struct DecoderLayerWeights {
  const void* input_norm = nullptr;          // [hidden]
  const void* post_norm = nullptr;           // [hidden]
  const void* packed[kProjCount] = {};       // linear_pack_cpu layout
  const void* bias[kProjCount] = {};         // [out] or null
  const void* lora_a[kProjCount] = {};       // [rank, in] (lora_dtype) or null: no adapter on it
  const void* lora_b[kProjCount] = {};       // B transposed: [rank, out]
  const void* lora_packed[kProjCount] = {};  // mask_lora_pack's layout of both, or null
  float lora_scale[kProjCount] = {};
};

struct DecoderArgs {
  int dtype = kFloat32;           // x, weights, k / v outputs
  std::int64_t batch = 0, n = 0;  // rows = batch * n
  std::int64_t hidden = 0, hq = 0, hkv = 0, head_dim = 0, intermediate = 0;
  float eps = 1e-6f;
  void* x = nullptr;           // [rows, hidden], updated in place
  const float* cos = nullptr;  // [rows, head_dim] (rope_tables)
  const float* sin = nullptr;
  // every layer-independent argument of the attention (mask, prefix metadata, strides of
  // the prefix); q / k / v / out and the prefix addresses are set per layer
  CascadeAttentionArgs attention;
  const void* prefix_k = nullptr;  // layer 0's prefix keys (null: no prefix)
  const void* prefix_v = nullptr;
  std::int64_t prefix_layer_stride = 0;  // elements between layers' prefixes
  void* k_out = nullptr;                 // [layers, rows, hkv, head_dim]
  void* v_out = nullptr;
  const std::int64_t* mask_rows = nullptr;  // rows at [MASK] tokens (the adapter's rows)
  std::int64_t num_mask_rows = 0;
  std::int64_t lora_rank = 0;
  int lora_dtype = kFloat32;   // every adapter matrix: float32 or bfloat16
  void* hidden_out = nullptr;  // [slots, rows, hidden]
  std::vector<int> record;     // per layer: slot for x after it, or -1
  std::vector<DecoderLayerWeights> layers;
  int num_threads = 1;
};

// Assumes validated arguments (decoder_bindings.cpp).
void decoder_layers_cpu(const DecoderArgs& args);

// out[i] = silu(gate[i]) * up[i] rounded as torch rounds F.silu(gate) * up in the dtype
// (silu rounded to the dtype, then the product); gate / up / out [rows, width] contiguous,
// out may alias gate.  Both paths of a forward (decoder_layers and the per-op MLP) call it,
// so they agree bit for bit; against torch's SiLU it may differ by a rounding.
void silu_mul_cpu(int dtype, std::int64_t rows, std::int64_t width, const void* gate, const void* up, void* out,
                  int num_threads);

}  // namespace dspec
