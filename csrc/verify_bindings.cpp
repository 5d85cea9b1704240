// pybind11 registrations of verify_chain / verify_tree in dspec._C (see verify.h for the
// design and the workspace layout): verify_chain, verify_tree, their *_workspace_bytes
// helpers, verify_draw_tile, and the constants ID_INT32 / ID_INT64, verify_draw_threads.
// Tensors cross as integer addresses (tensor.data_ptr()).  Every argument is validated
// before anything is read or written; a bad one raises ValueError (std::invalid_argument)
// naming it.
#include "verify_bindings.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "checks.h"
#include "dspec.h"
#include "verify.h"

namespace py = pybind11;

namespace dspec {
namespace {

std::string op_workspace_hint(const std::string& op) {
  return "_C." + op + "_workspace_bytes(batch, " + (op == "verify_tree" ? "nodes" : "length") +
         ", vocab, dtype, sampling, ts_splits)";
}

// The layout's byte count, or -1 if it would not fit comfortably in an int64.
std::int64_t checked_layout_bytes(std::int64_t batch, std::int64_t positions, std::int64_t vocab, int dtype,
                                  std::int64_t excl_cap, bool sampling, std::int64_t ts_splits, bool block = false,
                                  std::int64_t resid_rows = 0) {
  using u128 = unsigned __int128;
  const u128 rows = static_cast<u128>(batch) * static_cast<u128>(positions);
  const u128 tiles = static_cast<u128>(draw_num_tiles(vocab, dtype));
  u128 bound = rows * 24 + rows * static_cast<u128>(ts_splits) * 24 + 16 * 256;
  if (sampling) bound += static_cast<u128>(batch) * (32 + 8 * static_cast<u128>(excl_cap) + 8 * tiles);
  if (sampling && block) bound += rows * 4 + static_cast<u128>(batch) * 4 + 2 * 256;
  bound += static_cast<u128>(resid_rows) * static_cast<u128>(vocab) * 4 + 256;
  if (bound >= (static_cast<u128>(1) << 62)) return -1;
  return verify_layout(batch, positions, vocab, dtype, excl_cap, sampling, ts_splits, block, resid_rows).bytes;
}

// A number of blocks per row (CUDA): in [1, 2^31).
void check_splits(const Checker& ck, std::int64_t splits, const char* name) {
  if (splits < 1 || splits > kI32Max) {
    ck.fail(std::string(name) + " must be in [1, 2^31), got " + std::to_string(splits));
  }
}

// Validation shared by both ops; fills the common arguments and returns whether the op runs
// on CUDA.  excl_cap: 1 (chain) or N.
bool validate_common(const Checker& ck, const std::string& device, std::int64_t logits_ptr, int dtype,
                     std::int64_t batch, std::int64_t positions, std::int64_t vocab, std::int64_t row_stride,
                     double temperature, std::int64_t coins_ptr, std::int64_t num_coins, std::int64_t uniforms_ptr,
                     std::int64_t ts_splits, std::int64_t draw_splits, std::int64_t workspace_ptr,
                     std::int64_t workspace_bytes, std::int64_t excl_cap, VerifyCommon& c, bool block = false,
                     std::int64_t resid_rows = 0) {
  const bool on_cuda = ck.device(device);
  ck.float_dtype(dtype, "dtype");
  ck.at_least(batch, 0, "batch");
  ck.vocab(vocab);
  ck.product(batch, positions, "batch * positions");
  const std::int64_t rows = batch * positions;
  ck.rows_stride(rows, vocab, row_stride, "vocab");
  if (std::isnan(temperature) || temperature == INFINITY) {
    ck.fail("temperature must be finite (<= 0 for greedy), got " + std::to_string(temperature));
  }
  const bool greedy = temperature <= 0.0;
  float inv_t = 1.0f;
  if (!greedy) {
    inv_t = static_cast<float>(1.0 / temperature);
    if (!(std::isfinite(inv_t) && inv_t > 0.0f)) {
      ck.fail("temperature is too small: 1 / temperature must be a finite float32, got temperature " +
              std::to_string(temperature));
    }
  }
  check_splits(ck, ts_splits, "ts_splits");
  check_splits(ck, draw_splits, "draw_splits");
  const std::int64_t tiles = draw_num_tiles(vocab, dtype);
  if (on_cuda) {
    if (rows > kI32Max / ts_splits) ck.fail("batch * positions * ts_splits must be < 2^31 (CUDA grid size)");
    if (batch > kI32Max / std::min(draw_splits, tiles)) ck.fail("batch * draw_splits must be < 2^31 (CUDA grid size)");
  }
  const std::int64_t need = checked_layout_bytes(batch, positions, vocab, dtype, excl_cap, !greedy, ts_splits, block,
                                                 greedy ? 0 : resid_rows);
  if (need < 0) ck.fail("the workspace would be too large (batch, positions, vocab or ts_splits too large)");
  if (batch > 0) {
    ck.ptr(logits_ptr, "logits_ptr", element_size(dtype));
    if (workspace_ptr == 0) {
      ck.fail("workspace_ptr is a null pointer; the op needs " + op_workspace_hint(ck.op) + " = " +
              std::to_string(need) + " bytes");
    }
    ck.ptr(workspace_ptr, "workspace_ptr", 16);
    if (workspace_bytes < need) {
      ck.fail("workspace_bytes is " + std::to_string(workspace_bytes) + ", the op needs " + std::to_string(need) +
              " (" + op_workspace_hint(ck.op) + ")");
    }
    if (!greedy) {
      if (num_coins > 0) ck.ptr(coins_ptr, "coins_ptr", 4);
      ck.ptr(uniforms_ptr, "uniforms_ptr", 4);
    }
  }
  c.logits = as_ptr<const void>(logits_ptr);
  c.dtype = dtype;
  c.batch = batch;
  c.positions = positions;
  c.vocab = vocab;
  c.row_stride = row_stride;
  c.greedy = greedy;
  c.inv_t = inv_t;
  c.coins = greedy ? nullptr : as_ptr<const float>(coins_ptr);
  c.uniforms = greedy ? nullptr : as_ptr<const float>(uniforms_ptr);
  c.ts_splits = ts_splits;  // the CPU ignores it, but the workspace layout depends on it
  c.draw_splits = std::min(draw_splits, tiles);
  c.workspace = as_ptr<void>(workspace_ptr);
  return on_cuda;
}

void verify_chain(std::int64_t logits_ptr, int dtype, std::int64_t batch, std::int64_t length, std::int64_t vocab,
                  std::int64_t row_stride, std::int64_t drafts_ptr, int draft_dtype, std::int64_t num_drafts_ptr,
                  std::int64_t q_ptr, int q_dtype, std::int64_t q_stride_b, std::int64_t q_stride_l,
                  std::int64_t coins_ptr, std::int64_t uniforms_ptr, double temperature, std::int64_t num_accepted_ptr,
                  std::int64_t tokens_ptr, const std::string& device, std::int64_t stream, std::int64_t ts_splits,
                  std::int64_t draw_splits, std::int64_t workspace_ptr, std::int64_t workspace_bytes, int num_threads,
                  int rule) {
  const Checker ck{"verify_chain"};
  // ---- validation: nothing is read or written before all of it passes ----
  if (rule != 0 && rule != 1) ck.fail("rule must be 0 (token) or 1 (block), got " + std::to_string(rule));
  ck.at_least(length, 0, "length");
  if (length == kI64Max) ck.fail("length is too large");
  ck.id_dtype(draft_dtype, "draft_dtype");
  if (q_ptr != 0) ck.float_dtype(q_dtype, "q_dtype");
  VerifyChainArgs a;
  ck.product(batch, length, "batch * length");
  const bool on_cuda = validate_common(ck, device, logits_ptr, dtype, batch, length + 1, vocab, row_stride, temperature,
                                       coins_ptr, batch * length, uniforms_ptr, ts_splits, draw_splits, workspace_ptr,
                                       workspace_bytes, 1, a, rule == 1);
  if (q_ptr != 0) {
    if (q_stride_b < 0 || q_stride_l < 0) {
      ck.fail("q_stride_b and q_stride_l must be >= 0, got " + std::to_string(q_stride_b) + ", " +
              std::to_string(q_stride_l));
    }
    using u128 = unsigned __int128;
    if (batch > 0 && length > 0) {
      const u128 extent = static_cast<u128>(batch - 1) * static_cast<u128>(q_stride_b) +
                          static_cast<u128>(length - 1) * static_cast<u128>(q_stride_l) + static_cast<u128>(vocab);
      if (extent >= (static_cast<u128>(1) << 62)) ck.fail("draft_probs offsets overflow int64 (q strides too large)");
    }
  }
  if (batch == 0) return;
  if (length > 0) ck.ptr(drafts_ptr, "drafts_ptr", id_size(draft_dtype));
  ck.optional_ptr(num_drafts_ptr, "num_drafts_ptr", 8);
  if (length > 0) ck.optional_ptr(q_ptr, "q_ptr", element_size(q_dtype));
  ck.ptr(num_accepted_ptr, "num_accepted_ptr", 8);
  ck.ptr(tokens_ptr, "tokens_ptr", 8);

  a.drafts = as_ptr<const void>(drafts_ptr);
  a.draft_dtype = draft_dtype;
  a.num_drafts = as_ptr<const std::int64_t>(num_drafts_ptr);
  a.q = length > 0 ? as_ptr<const void>(q_ptr) : nullptr;
  a.q_dtype = q_dtype;
  a.q_stride_b = q_stride_b;
  a.q_stride_l = q_stride_l;
  a.num_accepted = as_ptr<std::int64_t>(num_accepted_ptr);
  a.tokens = as_ptr<std::int64_t>(tokens_ptr);
  a.block = rule == 1;
  if (!on_cuda) a.num_threads = caller_threads(num_threads);
  run_op(on_cuda, a, stream, verify_chain_cpu, DSPEC_IF_CUDA(verify_chain_cuda));
}

void verify_tree(std::int64_t logits_ptr, int dtype, std::int64_t batch, std::int64_t nodes, std::int64_t vocab,
                 std::int64_t row_stride, std::int64_t tokens_ptr, int token_dtype, std::int64_t parents_ptr,
                 int parent_dtype, std::int64_t coins_ptr, std::int64_t uniforms_ptr, double temperature,
                 std::int64_t num_accepted_ptr, std::int64_t path_ptr, std::int64_t out_ptr, const std::string& device,
                 std::int64_t stream, std::int64_t ts_splits, std::int64_t draw_splits, std::int64_t workspace_ptr,
                 std::int64_t workspace_bytes, int num_threads, std::int64_t q_ptr, int q_dtype,
                 std::int64_t q_stride_b, std::int64_t q_stride_n, int draft_sampling) {
  const Checker ck{"verify_tree"};
  if (nodes < 1) ck.fail("nodes must be >= 1 (node 0 is the root), got " + std::to_string(nodes));
  ck.id_dtype(token_dtype, "token_dtype");
  ck.id_dtype(parent_dtype, "parent_dtype");
  if (q_ptr != 0) ck.float_dtype(q_dtype, "q_dtype");
  if (draft_sampling != 0 && draft_sampling != 1) {
    ck.fail("draft_sampling must be 0 (independent) or 1 (without replacement), got " + std::to_string(draft_sampling));
  }
  VerifyTreeArgs a;
  ck.product(batch, nodes, "batch * nodes");
  const bool with_q = q_ptr != 0 && temperature > 0.0;
  const bool on_cuda = validate_common(ck, device, logits_ptr, dtype, batch, nodes, vocab, row_stride, temperature,
                                       coins_ptr, batch * nodes, uniforms_ptr, ts_splits, draw_splits, workspace_ptr,
                                       workspace_bytes, nodes, a, false, with_q ? batch : 0);
  if (with_q) {
    if (q_stride_b < 0 || q_stride_n < 0) {
      ck.fail("q_stride_b and q_stride_n must be >= 0, got " + std::to_string(q_stride_b) + ", " +
              std::to_string(q_stride_n));
    }
    using u128 = unsigned __int128;
    if (batch > 0) {
      const u128 extent = static_cast<u128>(batch - 1) * static_cast<u128>(q_stride_b) +
                          static_cast<u128>(nodes - 1) * static_cast<u128>(q_stride_n) + static_cast<u128>(vocab);
      if (extent >= (static_cast<u128>(1) << 62)) ck.fail("draft_probs offsets overflow int64 (q strides too large)");
    }
  }
  if (batch == 0) return;
  if (with_q) ck.ptr(q_ptr, "q_ptr", element_size(q_dtype));
  ck.ptr(tokens_ptr, "tokens_ptr", id_size(token_dtype));
  ck.ptr(parents_ptr, "parents_ptr", id_size(parent_dtype));
  ck.ptr(num_accepted_ptr, "num_accepted_ptr", 8);
  ck.ptr(path_ptr, "path_ptr", 8);
  ck.ptr(out_ptr, "out_ptr", 8);

  a.tokens = as_ptr<const void>(tokens_ptr);
  a.token_dtype = token_dtype;
  a.parents = as_ptr<const void>(parents_ptr);
  a.parent_dtype = parent_dtype;
  a.num_accepted = as_ptr<std::int64_t>(num_accepted_ptr);
  a.path = as_ptr<std::int64_t>(path_ptr);
  a.out = as_ptr<std::int64_t>(out_ptr);
  if (with_q) {
    a.q = as_ptr<const void>(q_ptr);
    a.q_dtype = q_dtype;
    a.q_stride_b = q_stride_b;
    a.q_stride_n = q_stride_n;
    a.without_replacement = draft_sampling == 1;
  }
  if (!on_cuda) a.num_threads = caller_threads(num_threads);
  run_op(on_cuda, a, stream, verify_tree_cpu, DSPEC_IF_CUDA(verify_tree_cuda));
}

std::int64_t verify_workspace_bytes(const Checker& ck, std::int64_t batch, std::int64_t positions, std::int64_t vocab,
                                    int dtype, bool sampling, std::int64_t ts_splits, std::int64_t excl_cap,
                                    bool block = false, std::int64_t resid_rows = 0) {
  ck.at_least(batch, 0, "batch");
  if (vocab < 1 || vocab > kI32Max) ck.fail("vocab must be in [1, 2^31), got " + std::to_string(vocab));
  ck.float_dtype(dtype, "dtype");
  check_splits(ck, ts_splits, "ts_splits");
  ck.product(batch, positions, "batch * positions");
  const std::int64_t need =
      checked_layout_bytes(batch, positions, vocab, dtype, excl_cap, sampling, ts_splits, block, resid_rows);
  if (need < 0) ck.fail("the workspace would be too large");
  return need;
}

std::int64_t verify_chain_workspace_bytes(std::int64_t batch, std::int64_t length, std::int64_t vocab, int dtype,
                                          bool sampling, std::int64_t ts_splits, int rule) {
  const Checker ck{"verify_chain_workspace_bytes"};
  if (length < 0 || length == kI64Max) ck.fail("length must be >= 0, got " + std::to_string(length));
  if (rule != 0 && rule != 1) ck.fail("rule must be 0 (token) or 1 (block), got " + std::to_string(rule));
  return verify_workspace_bytes(ck, batch, length + 1, vocab, dtype, sampling, ts_splits, 1, rule == 1);
}

std::int64_t verify_tree_workspace_bytes(std::int64_t batch, std::int64_t nodes, std::int64_t vocab, int dtype,
                                         bool sampling, std::int64_t ts_splits, bool with_q) {
  const Checker ck{"verify_tree_workspace_bytes"};
  ck.at_least(nodes, 1, "nodes");
  return verify_workspace_bytes(ck, batch, nodes, vocab, dtype, sampling, ts_splits, nodes, false,
                                sampling && with_q ? batch : 0);
}

}  // namespace

void register_verify(py::module_& m) {
  m.attr("ID_INT32") = py::int_(static_cast<int>(dspec::kInt32));
  m.attr("ID_INT64") = py::int_(static_cast<int>(dspec::kInt64));
  m.attr("verify_draw_threads") = py::int_(dspec::kVerifyDrawThreads);
  m.def(
      "verify_draw_tile",
      [](int dtype) {
        Checker{"verify_draw_tile"}.float_dtype(dtype, "dtype");
        return dspec::draw_tile(dtype);
      },
      py::arg("dtype"), "Vocabulary columns per tile of the verify draw for a logits dtype code (1024 or 2048).");

  m.def("verify_chain", &verify_chain, py::arg("logits_ptr"), py::arg("dtype"), py::arg("batch"), py::arg("length"),
        py::arg("vocab"), py::arg("row_stride"), py::arg("drafts_ptr"), py::arg("draft_dtype"),
        py::arg("num_drafts_ptr"), py::arg("q_ptr"), py::arg("q_dtype"), py::arg("q_stride_b"), py::arg("q_stride_l"),
        py::arg("coins_ptr"), py::arg("uniforms_ptr"), py::arg("temperature"), py::arg("num_accepted_ptr"),
        py::arg("tokens_ptr"), py::arg("device"), py::arg("stream") = 0, py::arg("ts_splits") = 1,
        py::arg("draw_splits") = 1, py::arg("workspace_ptr") = 0, py::arg("workspace_bytes") = 0,
        py::arg("num_threads") = 0, py::arg("rule") = 0,
        R"doc(Fused speculative verification of a chain of drafts (dspec.verify_chain).

logits_ptr: the target logits as batch * (length + 1) rows of vocab (dtype 0 float32,
1 float16, 2 bfloat16), unit stride along vocab, row_stride elements between rows.
drafts_ptr: [batch, length] contiguous ids (draft_dtype 0 int32, 1 int64).
num_drafts_ptr: [batch] int64 (clamped to [0, length]) or 0 for `length` everywhere.
q_ptr: draft_probs (q_dtype) with element strides q_stride_b, q_stride_l and unit stride
along vocab, or 0 for one-hot drafts.  coins_ptr [batch, length] and uniforms_ptr [batch]:
contiguous float32 (read only when temperature > 0).  temperature <= 0 is greedy.
Outputs: num_accepted_ptr [batch] int64, tokens_ptr [batch, length + 1] int64 (accepted
drafts, the final token, then -1).  device "cpu" (C++, GIL released) or "cuda" (launched on
`stream` on the current device; no host sync, no allocation).  ts_splits: token_stats
vocabulary splits, draw_splits: blocks per row of the draw (CUDA; the CPU ignores both but
the workspace layout depends on ts_splits).  workspace_ptr / workspace_bytes: at least
verify_chain_workspace_bytes(batch, length, vocab, dtype, temperature > 0, ts_splits, rule)
bytes, 16-byte aligned.  num_threads: CPU threads at most (0: dspec.cpu.kernel_threads()).
rule: 0 token-wise acceptance, 1 block verification (dspec.verify_chain(rule="block"); only
when sampling).
batch == 0 is a no-op.  Ids outside [0, vocab) are never read (a
draft holding one is rejected).  Raises ValueError for a bad argument (before any work),
RuntimeError when a CUDA launch fails.)doc");

  m.def("verify_tree", &verify_tree, py::arg("logits_ptr"), py::arg("dtype"), py::arg("batch"), py::arg("nodes"),
        py::arg("vocab"), py::arg("row_stride"), py::arg("tokens_ptr"), py::arg("token_dtype"), py::arg("parents_ptr"),
        py::arg("parent_dtype"), py::arg("coins_ptr"), py::arg("uniforms_ptr"), py::arg("temperature"),
        py::arg("num_accepted_ptr"), py::arg("path_ptr"), py::arg("out_ptr"), py::arg("device"), py::arg("stream") = 0,
        py::arg("ts_splits") = 1, py::arg("draw_splits") = 1, py::arg("workspace_ptr") = 0,
        py::arg("workspace_bytes") = 0, py::arg("num_threads") = 0, py::arg("q_ptr") = 0, py::arg("q_dtype") = 0,
        py::arg("q_stride_b") = 0, py::arg("q_stride_n") = 0, py::arg("draft_sampling") = 0,
        R"doc(Fused speculative verification of a token tree (dspec.verify_tree).

logits_ptr: batch * nodes rows of vocab (as verify_chain).  tokens_ptr, parents_ptr:
[batch, nodes] contiguous ids (token_dtype / parent_dtype 0 int32, 1 int64); a parent
outside [0, c) makes node c padding.  coins_ptr [batch, nodes], uniforms_ptr [batch]:
contiguous float32 (temperature > 0 only).  Outputs, all [batch] / [batch, nodes] int64:
num_accepted_ptr, path_ptr (accepted node indices, then -1), out_ptr (their tokens, the
final token, then -1).  Workspace: verify_tree_workspace_bytes(batch, nodes, vocab, dtype,
temperature > 0, ts_splits, q_ptr != 0) bytes.  q_ptr: draft_probs [batch, nodes, vocab]
(q_dtype, element strides q_stride_b, q_stride_n, unit stride along vocab) or 0 for one-hot
drafts; read only when temperature > 0.  draft_sampling: how each node's children were drawn
from its q row, 0 independently, 1 without replacement.  Other arguments as verify_chain.)doc");

  m.def("verify_chain_workspace_bytes", &verify_chain_workspace_bytes, py::arg("batch"), py::arg("length"),
        py::arg("vocab"), py::arg("dtype"), py::arg("sampling"), py::arg("ts_splits") = 1, py::arg("rule") = 0,
        "Bytes of workspace verify_chain needs (sampling: temperature > 0; rule 0 token, 1 block).");
  m.def("verify_tree_workspace_bytes", &verify_tree_workspace_bytes, py::arg("batch"), py::arg("nodes"),
        py::arg("vocab"), py::arg("dtype"), py::arg("sampling"), py::arg("ts_splits") = 1, py::arg("with_q") = false,
        "Bytes of workspace verify_tree needs (sampling: temperature > 0; with_q: with draft_probs).");
}

}  // namespace dspec
