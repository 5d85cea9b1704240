// pybind11 registration of the decoder layers in one call (decoder.h) and of silu_mul.
// Every argument is checked before anything is read or written (ValueError naming it).
#include "decoder_bindings.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_bindings.h"
#include "checks.h"
#include "decoder.h"
#include "layer_ops_bindings.h"

namespace py = pybind11;

namespace dspec {
namespace {

constexpr int kWeightsPerLayer = 2 + 2 * kProjCount;  // two norms, packed weights, biases

void silu_mul(std::int64_t gate, std::int64_t up, std::int64_t out, int dtype, std::int64_t rows, std::int64_t width,
              int num_threads) {
  const Checker c{"silu_mul"};
  c.float_dtype(dtype, "dtype");
  c.at_least(rows, 0, "rows");
  c.at_least(width, 1, "width");
  c.product(rows, width, "rows * width");
  if (rows == 0) return;
  const std::int64_t item = element_size(dtype);
  c.ptr(gate, "gate", item);
  c.ptr(up, "up", item);
  c.ptr(out, "out", item);
  py::gil_scoped_release release;
  silu_mul_cpu(dtype, rows, width, as_ptr<const void>(gate), as_ptr<const void>(up), as_ptr<void>(out),
               num_threads < 1 ? 1 : num_threads);
}

void decoder_layers(std::int64_t x, int dtype, std::int64_t batch, std::int64_t n, std::int64_t hidden, std::int64_t hq,
                    std::int64_t hkv, std::int64_t head_dim, std::int64_t intermediate, double eps, std::int64_t cos,
                    std::int64_t sin, std::int64_t mask, std::int64_t mask_s0, std::int64_t mask_s1,
                    std::int64_t prefix_k, std::int64_t prefix_v, std::int64_t prefix_indptr, int indptr_dtype,
                    std::int64_t page_table, std::int64_t prefix_lens, std::int64_t prefix_rows, std::int64_t page_size,
                    std::int64_t max_pages, std::int64_t page_table_stride, std::int64_t pk_s0, std::int64_t pk_s1,
                    std::int64_t pk_s2, std::int64_t pv_s0, std::int64_t pv_s1, std::int64_t pv_s2,
                    std::int64_t prefix_layer_stride, double sm_scale, const std::vector<std::int64_t>& weights,
                    const std::vector<std::int64_t>& lora, const std::vector<double>& lora_scales,
                    std::int64_t lora_rank, std::int64_t mask_rows, std::int64_t num_mask_rows, std::int64_t k_out,
                    std::int64_t v_out, std::int64_t hidden_out, std::int64_t hidden_slots,
                    const std::vector<int>& record, int num_threads, int lora_dtype,
                    const std::vector<std::int64_t>& lora_packed) {
  const Checker c{"decoder_layers"};
  c.float_dtype(dtype, "dtype");
  if (lora_dtype != kFloat32 && lora_dtype != kBFloat16) {
    c.fail("lora_dtype must be 0 (float32) or 2 (bfloat16), got " + std::to_string(lora_dtype));
  }
  const std::int64_t lora_item = element_size(lora_dtype);
  c.at_least(batch, 0, "batch");
  c.at_least(n, 0, "n");
  c.at_least(hidden, 1, "hidden");
  c.at_least(intermediate, 1, "intermediate");
  check_rope_head_dim(c, head_dim);
  if (!(eps > 0.0) || !std::isfinite(eps)) c.fail("eps must be a finite number > 0, got " + std::to_string(eps));
  if (weights.empty() || weights.size() % kWeightsPerLayer != 0) {
    c.fail("weights must hold " + std::to_string(kWeightsPerLayer) + " addresses per layer (2 norms, " +
           std::to_string(kProjCount) + " packed projections, their biases), got " + std::to_string(weights.size()));
  }
  const std::size_t layers = weights.size() / kWeightsPerLayer;
  if (!lora.empty() && lora.size() != layers * 2 * kProjCount) {
    c.fail("lora must be empty or hold 2 addresses per projection per layer (" +
           std::to_string(layers * 2 * kProjCount) + "), got " + std::to_string(lora.size()));
  }
  if (!lora_packed.empty() && (lora.empty() || lora_packed.size() != layers * kProjCount)) {
    c.fail("lora_packed must be empty or hold one address per projection per layer (" +
           std::to_string(layers * kProjCount) + ") beside lora, got " + std::to_string(lora_packed.size()));
  }
  if (!lora.empty() && lora_scales.size() != layers * kProjCount) {
    c.fail("lora_scales must hold one scale per projection per layer (" + std::to_string(layers * kProjCount) +
           "), got " + std::to_string(lora_scales.size()));
  }
  if (record.size() != layers) {
    c.fail("record must hold one entry per layer (" + std::to_string(layers) + "), got " +
           std::to_string(record.size()));
  }
  c.at_least(hidden_slots, 0, "hidden_slots");
  c.at_least(num_mask_rows, 0, "num_mask_rows");
  c.at_least(prefix_layer_stride, 0, "prefix_layer_stride");
  const std::int64_t rows = batch * n;
  c.product(batch, n, "batch * n");
  c.product(rows, std::max(hidden, std::max(intermediate, hq * head_dim)), "rows * width");
  c.product(static_cast<std::int64_t>(layers) * rows, hkv * head_dim, "layers * rows * hkv * head_dim");
  const std::int64_t item = element_size(dtype);
  const std::int64_t qw = hq * head_dim, kvw = hkv * head_dim;

  DecoderArgs a;
  // the attention's layer-independent arguments, checked as cascade_attention checks them
  // (k_out stands for the per-layer q / k / v / out buffers: same dtype, contiguous)
  if (!cascade_args(c, a.attention, k_out, k_out, k_out, k_out, 0, mask, prefix_k, prefix_v, prefix_indptr, page_table,
                    prefix_lens, dtype, batch, n, hq, hkv, head_dim, sm_scale, n * qw, qw, head_dim, n * kvw, kvw,
                    head_dim, n * kvw, kvw, head_dim, n * qw, qw, head_dim, mask_s0, mask_s1, pk_s0, pk_s1, pk_s2,
                    pv_s0, pv_s1, pv_s2, indptr_dtype, prefix_rows, page_size, max_pages, page_table_stride,
                    num_threads, "auto")) {
    return;  // no rows
  }
  c.ptr(x, "x", item);
  c.ptr(cos, "cos", 4);
  c.ptr(sin, "sin", 4);
  c.ptr(v_out, "v_out", item);
  if (a.attention.prefix != kPrefixNone && layers > 1) {
    c.product(static_cast<std::int64_t>(layers), prefix_layer_stride, "layers * prefix_layer_stride");
  }
  a.layers.resize(layers);
  for (std::size_t l = 0; l < layers; ++l) {
    const std::string at = "[" + std::to_string(l * kWeightsPerLayer) + " + ";
    const std::int64_t* w = weights.data() + l * kWeightsPerLayer;
    DecoderLayerWeights& lw = a.layers[l];
    c.ptr(w[0], ("weights" + at + "0] (input norm)").c_str(), item);
    c.ptr(w[1], ("weights" + at + "1] (post-attention norm)").c_str(), item);
    lw.input_norm = as_ptr<const void>(w[0]);
    lw.post_norm = as_ptr<const void>(w[1]);
    for (int p = 0; p < kProjCount; ++p) {
      c.ptr(w[2 + p], ("weights" + at + std::to_string(2 + p) + "] (packed projection)").c_str(), item);
      c.optional_ptr(w[2 + kProjCount + p], ("weights" + at + std::to_string(2 + kProjCount + p) + "] (bias)").c_str(),
                     item);
      lw.packed[p] = as_ptr<const void>(w[2 + p]);
      lw.bias[p] = w[2 + kProjCount + p] == 0 ? nullptr : as_ptr<const void>(w[2 + kProjCount + p]);
      if (!lora.empty()) {
        const std::int64_t la = lora[(l * kProjCount + p) * 2], lb = lora[(l * kProjCount + p) * 2 + 1];
        if ((la == 0) != (lb == 0)) c.fail("lora: give both addresses of a projection's adapter or neither");
        c.optional_ptr(la, "lora (A)", lora_item);
        c.optional_ptr(lb, "lora (B)", lora_item);
        lw.lora_a[p] = la == 0 ? nullptr : as_ptr<const void>(la);
        lw.lora_b[p] = lb == 0 ? nullptr : as_ptr<const void>(lb);
        lw.lora_scale[p] = static_cast<float>(lora_scales[l * kProjCount + p]);
        if (!lora_packed.empty()) {
          const std::int64_t lp = lora_packed[l * kProjCount + p];
          if (lp != 0 && la == 0) c.fail("lora_packed: a packed adapter for a projection without one");
          c.optional_ptr(lp, "lora_packed", 2);
          lw.lora_packed[p] = lp == 0 ? nullptr : as_ptr<const void>(lp);
        }
      }
    }
  }
  if (num_mask_rows > 0) {
    if (lora.empty()) c.fail("mask_rows without lora: the rows select an adapter's update");
    c.at_least(lora_rank, 1, "lora_rank");
    c.ptr(mask_rows, "mask_rows", 8);
    const std::int64_t* r = as_ptr<const std::int64_t>(mask_rows);
    for (std::int64_t i = 0; i < num_mask_rows; ++i) {
      if (r[i] < 0 || r[i] >= rows) {
        c.fail("mask_rows must lie in [0, batch * n = " + std::to_string(rows) + "), got " + std::to_string(r[i]));
      }
    }
  }
  for (std::size_t l = 0; l < layers; ++l) {
    if (record[l] < -1 || record[l] >= hidden_slots) {
      c.fail("record[" + std::to_string(l) + "] = " + std::to_string(record[l]) + " is not -1 or a slot in [0, " +
             std::to_string(hidden_slots) + ")");
    }
    if (record[l] >= 0) c.ptr(hidden_out, "hidden_out", item);
  }
  a.dtype = dtype;
  a.batch = batch;
  a.n = n;
  a.hidden = hidden;
  a.hq = hq;
  a.hkv = hkv;
  a.head_dim = head_dim;
  a.intermediate = intermediate;
  a.eps = static_cast<float>(eps);
  a.x = as_ptr<void>(x);
  a.cos = as_ptr<const float>(cos);
  a.sin = as_ptr<const float>(sin);
  a.prefix_k = a.attention.prefix_k;
  a.prefix_v = a.attention.prefix_v;
  a.prefix_layer_stride = prefix_layer_stride;
  a.k_out = as_ptr<void>(k_out);
  a.v_out = as_ptr<void>(v_out);
  a.mask_rows = as_ptr<const std::int64_t>(mask_rows);
  a.num_mask_rows = num_mask_rows;
  a.lora_rank = lora_rank;
  a.lora_dtype = lora_dtype;
  a.hidden_out = as_ptr<void>(hidden_out);
  a.record = record;
  a.num_threads = a.attention.num_threads;
  py::gil_scoped_release release;
  decoder_layers_cpu(a);
}

}  // namespace

void register_decoder(py::module_& m) {
  m.def("silu_mul", &silu_mul, py::arg("gate"), py::arg("up"), py::arg("out"), py::arg("dtype"), py::arg("rows"),
        py::arg("width"), py::arg("num_threads") = 1,
        R"doc(out = silu(gate) * up on [rows, width] contiguous tensors of dtype (0 fp32, 1 fp16, 2 bf16),
rounded as torch rounds F.silu(gate) * up (silu to the dtype, then the product); out may be gate.  The
model's per-op MLP and decoder_layers both use it, so they agree bit for bit.)doc");
  m.def("decoder_layers", &decoder_layers, py::arg("x"), py::arg("dtype"), py::arg("batch"), py::arg("n"),
        py::arg("hidden"), py::arg("hq"), py::arg("hkv"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
        py::arg("cos"), py::arg("sin"), py::arg("mask"), py::arg("mask_s0"), py::arg("mask_s1"), py::arg("prefix_k"),
        py::arg("prefix_v"), py::arg("prefix_indptr"), py::arg("indptr_dtype"), py::arg("page_table"),
        py::arg("prefix_lens"), py::arg("prefix_rows"), py::arg("page_size"), py::arg("max_pages"),
        py::arg("page_table_stride"), py::arg("prefix_k_s0"), py::arg("prefix_k_s1"), py::arg("prefix_k_s2"),
        py::arg("prefix_v_s0"), py::arg("prefix_v_s1"), py::arg("prefix_v_s2"), py::arg("prefix_layer_stride"),
        py::arg("sm_scale"), py::arg("weights"), py::arg("lora"), py::arg("lora_scales"), py::arg("lora_rank"),
        py::arg("mask_rows"), py::arg("num_mask_rows"), py::arg("k_out"), py::arg("v_out"), py::arg("hidden_out"),
        py::arg("hidden_slots"), py::arg("record"), py::arg("num_threads"), py::arg("lora_dtype") = 0,
        py::arg("lora_packed") = std::vector<std::int64_t>{},
        R"doc(Every decoder layer of a Llama-style model for one inference forward on the CPU (decoder.h).

x [B * N, hidden] (dtype 0 fp32, 1 fp16, 2 bf16) is updated in place; cos / sin float32 [B * N, head_dim]
(rope_tables).  The attention's mask and prefix arguments are cascade_attention's, prefix_k / prefix_v
being layer 0's and layer l's at + l * prefix_layer_stride elements.  weights: per layer the input and
post-attention norm weights, the packed (linear_pack) q, k, v, o, gate, up, down and their biases (0:
none).  lora: empty, or per layer and projection the A [rank, in] and B^T [rank, out] of a mask adapter
(0, 0: none; lora_dtype 0 float32 or 2 bfloat16, the math float32 either way) with lora_scales; its update
is added at the int64 mask_rows.  lora_packed: empty, or per layer and projection mask_lora_pack's
layout of that adapter (0: none), which mask_lora's AMX code reads where it runs.  k_out / v_out
[layers, B * N, hkv, head_dim] receive each layer's rotated keys and values; record[l] >= 0 copies x
after layer l into slot record[l] of hidden_out [hidden_slots, B * N, hidden].  Bit-identical to the
per-op path (rms_norm, linear_group, mask_lora, rope, cascade_attention, silu_mul, torch's adds).)doc");
}

}  // namespace dspec
