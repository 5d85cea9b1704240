// pybind11 registrations of the masks ops in dspec._C (see masks.h for the layout):
//   pack_mask, unpack_mask, tree_mask, draft_tree, and the constants tree_mask_max_nodes,
//   INDEX_INT32 / INDEX_INT64.
// Tensors cross as integer addresses (tensor.data_ptr()).  Every argument is validated
// before anything is read or written; a bad one raises ValueError naming it.
#include "masks_bindings.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "checks.h"
#include "masks.h"

namespace py = pybind11;

namespace dspec {
namespace {

static_assert(int{kIndexInt32} == int{kInt32} && int{kIndexInt64} == int{kInt64},
              "index dtype codes are id dtype codes");

void pack_mask(std::int64_t mask_ptr, std::int64_t rows, std::int64_t num_keys, std::int64_t row_stride,
               std::int64_t words_ptr, const std::string& device, std::int64_t stream) {
  const Checker c{"pack_mask"};
  const bool on_cuda = c.device(device);
  c.at_least(rows, 0, "rows");
  c.at_least(num_keys, 0, "num_keys");
  c.rows_stride(rows, num_keys, row_stride);
  c.product(rows, mask_words(num_keys) * 4, "rows * num_words * 4");
  if (rows == 0 || num_keys == 0) return;  // empty tensors may report data_ptr() == 0
  c.ptr(mask_ptr, "mask_ptr", 1);
  c.ptr(words_ptr, "words_ptr", 4);
  PackMaskArgs a;
  a.mask = as_ptr<const std::uint8_t>(mask_ptr);
  a.rows = rows;
  a.num_keys = num_keys;
  a.row_stride = row_stride;
  a.words = as_ptr<std::int32_t>(words_ptr);
  run_op(on_cuda, a, stream, pack_mask_cpu, DSPEC_IF_CUDA(pack_mask_cuda));
}

void unpack_mask(std::int64_t words_ptr, std::int64_t rows, std::int64_t num_words, std::int64_t row_stride,
                 std::int64_t num_keys, std::int64_t out_ptr, const std::string& device, std::int64_t stream) {
  const Checker c{"unpack_mask"};
  const bool on_cuda = c.device(device);
  c.at_least(rows, 0, "rows");
  c.at_least(num_words, 0, "num_words");
  c.at_least(num_keys, 0, "num_keys");
  if (num_words > kI64Max / 32 || num_keys > 32 * num_words) {
    c.fail("num_keys must be <= 32 * num_words (" + std::to_string(num_words) + " words), got " +
           std::to_string(num_keys));
  }
  c.rows_stride(rows, num_words, row_stride);
  c.product(rows, num_keys, "rows * num_keys");
  if (rows == 0 || num_keys == 0) return;
  c.ptr(words_ptr, "words_ptr", 4);
  c.ptr(out_ptr, "out_ptr", 1);
  UnpackMaskArgs a;
  a.words = as_ptr<const std::int32_t>(words_ptr);
  a.rows = rows;
  a.num_words = num_words;
  a.row_stride = row_stride;
  a.num_keys = num_keys;
  a.out = as_ptr<std::uint8_t>(out_ptr);
  run_op(on_cuda, a, stream, unpack_mask_cpu, DSPEC_IF_CUDA(unpack_mask_cuda));
}

void tree_mask(std::int64_t parents_ptr, int dtype, std::int64_t batch, std::int64_t nodes, std::int64_t row_stride,
               std::int64_t words_ptr, std::int64_t depth_ptr, const std::string& device, std::int64_t stream) {
  const Checker c{"tree_mask"};
  const bool on_cuda = c.device(device);
  c.id_dtype(dtype, "dtype");
  c.at_least(batch, 0, "batch");
  if (nodes < 1) c.fail("nodes must be >= 1 (node 0 is the root), got " + std::to_string(nodes));
  if (on_cuda && nodes > kTreeMaskMaxNodes) {
    c.fail("nodes must be <= " + std::to_string(kTreeMaskMaxNodes) + " on CUDA, got " + std::to_string(nodes));
  }
  if (on_cuda && batch > kI32Max) c.fail("batch must be < 2^31 (CUDA grid size), got " + std::to_string(batch));
  c.rows_stride(batch, nodes, row_stride);
  c.product(nodes, mask_words(nodes) * 4, "nodes * num_words * 4");
  c.product(batch, nodes * mask_words(nodes) * 4, "batch * nodes * num_words * 4");
  if (batch == 0) return;
  c.ptr(parents_ptr, "parents_ptr", id_size(dtype));
  c.ptr(words_ptr, "words_ptr", 4);
  c.ptr(depth_ptr, "depth_ptr", 8);
  TreeMaskArgs a;
  a.parents = as_ptr<const void>(parents_ptr);
  a.dtype = dtype;
  a.batch = batch;
  a.nodes = nodes;
  a.row_stride = row_stride;
  a.words = as_ptr<std::int32_t>(words_ptr);
  a.depth = as_ptr<std::int64_t>(depth_ptr);
  run_op(on_cuda, a, stream, tree_mask_cpu, DSPEC_IF_CUDA(tree_mask_cuda));
}

std::int64_t draft_tree(std::int64_t probs_ptr, std::int64_t tokens_ptr, std::int64_t root_tokens_ptr,
                        std::int64_t root_positions_ptr, std::int64_t batch, std::int64_t slots, std::int64_t k,
                        std::int64_t nodes, double row_cost, std::int64_t capacity, std::int64_t out_tokens_ptr,
                        std::int64_t out_parents_ptr, std::int64_t out_positions_ptr, std::int64_t words_ptr) {
  const Checker c{"draft_tree"};
  c.at_least(batch, 0, "batch");
  c.at_least(slots, 1, "slots");
  c.at_least(k, 1, "k");
  c.at_least(nodes, 1, "nodes");
  c.product(batch, slots * k, "batch * slots * k");
  // the paths a beam of `nodes` per slot can hold: capacity must equal min(nodes, that)
  std::int64_t paths = 0, width = 1;
  for (std::int64_t d = 0; d < slots && paths < nodes; ++d) {
    width = std::min<std::int64_t>(nodes, width * k);
    paths += width;
  }
  if (capacity != std::min(nodes, paths)) {
    c.fail("capacity must be min(nodes, paths) = " + std::to_string(std::min(nodes, paths)) + ", got " +
           std::to_string(capacity));
  }
  c.product(batch, (1 + capacity) * mask_words(1 + capacity) * 4, "batch * (1 + capacity) * num_words * 4");
  if (!(row_cost >= 0.0) && row_cost != -1.0) {
    c.fail("row_cost must be >= 0 (or -1: no pruning), got " + std::to_string(row_cost));
  }
  if (batch == 0) return 0;
  c.ptr(probs_ptr, "probs_ptr", 4);
  c.ptr(tokens_ptr, "tokens_ptr", 8);
  c.ptr(root_tokens_ptr, "root_tokens_ptr", 8);
  c.ptr(root_positions_ptr, "root_positions_ptr", 8);
  c.ptr(out_tokens_ptr, "out_tokens_ptr", 8);
  c.ptr(out_parents_ptr, "out_parents_ptr", 8);
  c.ptr(out_positions_ptr, "out_positions_ptr", 8);
  c.ptr(words_ptr, "words_ptr", 4);
  const float* probs = as_ptr<const float>(probs_ptr);
  for (std::int64_t i = 0; i < batch * slots * k; ++i) {
    if (probs[i] != probs[i]) c.fail("probs holds NaN at flat index " + std::to_string(i));
  }
  DraftTreeArgs a;
  a.probs = probs;
  a.tokens = as_ptr<const std::int64_t>(tokens_ptr);
  a.root_tokens = as_ptr<const std::int64_t>(root_tokens_ptr);
  a.root_positions = as_ptr<const std::int64_t>(root_positions_ptr);
  a.batch = batch;
  a.slots = slots;
  a.k = k;
  a.nodes = nodes;
  a.row_cost = row_cost;
  a.capacity = capacity;
  a.out_tokens = as_ptr<std::int64_t>(out_tokens_ptr);
  a.out_parents = as_ptr<std::int64_t>(out_parents_ptr);
  a.out_positions = as_ptr<std::int64_t>(out_positions_ptr);
  a.words = as_ptr<std::int32_t>(words_ptr);
  py::gil_scoped_release release;
  return draft_tree_cpu(a);
}

}  // namespace

void register_masks(py::module_& m) {
  m.attr("tree_mask_max_nodes") = py::int_(kTreeMaskMaxNodes);
  m.attr("INDEX_INT32") = py::int_(static_cast<int>(kIndexInt32));
  m.attr("INDEX_INT64") = py::int_(static_cast<int>(kIndexInt64));

  m.def("pack_mask", &pack_mask, py::arg("mask_ptr"), py::arg("rows"), py::arg("num_keys"), py::arg("row_stride"),
        py::arg("words_ptr"), py::arg("device"), py::arg("stream") = 0,
        R"doc(Pack a boolean mask into 32-bit words.

mask_ptr: rows x num_keys bytes (torch.bool; non-zero is set), unit stride along keys,
row_stride bytes between rows.  words_ptr: rows x ceil(num_keys / 32) int32, contiguous;
bit j of word w is key 32 w + j, bits past num_keys are 0.  device "cpu" or "cuda" (launch
on `stream` on the current device).  rows == 0 or num_keys == 0 is a no-op.)doc");

  m.def("unpack_mask", &unpack_mask, py::arg("words_ptr"), py::arg("rows"), py::arg("num_words"), py::arg("row_stride"),
        py::arg("num_keys"), py::arg("out_ptr"), py::arg("device"), py::arg("stream") = 0,
        R"doc(Unpack 32-bit mask words into bytes (0 / 1).

words_ptr: rows x num_words int32, unit stride, row_stride elements between rows;
num_keys <= 32 * num_words (later bits are ignored).  out_ptr: rows x num_keys bytes,
contiguous.  rows == 0 or num_keys == 0 is a no-op.)doc");

  m.def("draft_tree", &draft_tree, py::arg("probs_ptr"), py::arg("tokens_ptr"), py::arg("root_tokens_ptr"),
        py::arg("root_positions_ptr"), py::arg("batch"), py::arg("slots"), py::arg("k"), py::arg("nodes"),
        py::arg("row_cost"), py::arg("capacity"), py::arg("out_tokens_ptr"), py::arg("out_parents_ptr"),
        py::arg("out_positions_ptr"), py::arg("words_ptr"),
        R"doc(The best draft tree over a block drafter's per-slot candidates (CPU).

probs_ptr float32 / tokens_ptr int64: batch x slots x k, contiguous (no NaN); the N = nodes
best paths by product of probabilities (a beam of N per slot), pruned to the count
maximising (1 + sum of scores) / (1 + row_cost n) when row_cost >= 0 (-1: none), the
largest over the batch; capacity = min(nodes, paths).  Writes, batch x (1 + capacity)
int64 each: tokens (column 0 root_tokens), parents (-1 for the root), positions
(root_positions + depth); words int32 batch x (1 + n) x ceil((1 + n) / 32), contiguous
(tree_mask's layout).  Returns n.)doc");

  m.def("tree_mask", &tree_mask, py::arg("parents_ptr"), py::arg("dtype"), py::arg("batch"), py::arg("nodes"),
        py::arg("row_stride"), py::arg("words_ptr"), py::arg("depth_ptr"), py::arg("device"), py::arg("stream") = 0,
        R"doc(Ancestor masks and depths of token trees.

parents_ptr: batch x nodes parents (dtype 0 int32, 1 int64), unit stride, row_stride
elements between rows; node 0 is the root; a parent outside [0, i) counts as -1 (padding:
sees only itself, depth 0).  words_ptr: batch x nodes x ceil(nodes / 32) int32 (node i's
row has the bits of i and its ancestors); depth_ptr: batch x nodes int64.  CUDA takes
nodes <= tree_mask_max_nodes (pointer jumping, one block per tree); the CPU code scans the
nodes in index order and takes any count.  batch == 0 is a no-op.)doc");
}

}  // namespace dspec
