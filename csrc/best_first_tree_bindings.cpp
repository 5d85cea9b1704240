// pybind11 registration of best_first_tree (best_first_tree.h).  Every argument is checked
// before anything is read or written (ValueError naming it).
#include "best_first_tree_bindings.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "best_first_tree.h"
#include "checks.h"

namespace py = pybind11;

namespace dspec {
namespace {

// k + k^2 + ... + k^slots, capped at cap (no overflow).
std::int64_t paths_capped(std::int64_t slots, std::int64_t k, std::int64_t cap) {
  std::int64_t total = 0, width = 1;
  for (std::int64_t d = 0; d < slots && total < cap; ++d) {
    width = width > cap / k ? cap : std::min(cap, width * k);
    total = std::min(cap, total + width);
  }
  return total;
}

void best_first_tree(std::int64_t probs_ptr, int probs_dtype, std::int64_t tokens_ptr, int tokens_dtype,
                     std::int64_t batch, std::int64_t slots, std::int64_t k, std::int64_t nodes,
                     std::int64_t out_tokens_ptr, std::int64_t out_parents_ptr, std::int64_t out_scores_ptr,
                     std::int64_t out_depth_ptr) {
  const Checker c{"best_first_tree"};
  c.float_dtype(probs_dtype, "probs_dtype");
  c.id_dtype(tokens_dtype, "tokens_dtype");
  c.at_least(batch, 0, "batch");
  c.at_least(slots, 1, "slots");
  c.at_least(k, 1, "k");
  c.at_least(nodes, 1, "nodes");
  c.product(slots, k, "slots * k");
  c.product(batch, slots * k, "batch * slots * k");
  c.product(batch, nodes, "batch * nodes");
  if (nodes > kI64Max / 2 - 1) c.fail("nodes is too large, got " + std::to_string(nodes));
  const std::int64_t paths = paths_capped(slots, k, nodes);
  if (nodes > paths) {
    c.fail("nodes must be <= the number of paths k + k^2 + ... + k^slots (" + std::to_string(paths) + "), got " +
           std::to_string(nodes));
  }
  if (batch == 0) return;
  c.ptr(probs_ptr, "probs_ptr", element_size(probs_dtype));
  c.ptr(tokens_ptr, "tokens_ptr", id_size(tokens_dtype));
  c.ptr(out_tokens_ptr, "out_tokens_ptr", 8);
  c.ptr(out_parents_ptr, "out_parents_ptr", 8);
  c.ptr(out_scores_ptr, "out_scores_ptr", 4);
  c.ptr(out_depth_ptr, "out_depth_ptr", 8);
  BestFirstTreeArgs a;
  a.probs = as_ptr<const void>(probs_ptr);
  a.probs_dtype = probs_dtype;
  a.tokens = as_ptr<const void>(tokens_ptr);
  a.tokens_dtype = tokens_dtype;
  a.batch = batch;
  a.slots = slots;
  a.k = k;
  a.nodes = nodes;
  a.out_tokens = as_ptr<std::int64_t>(out_tokens_ptr);
  a.out_parents = as_ptr<std::int64_t>(out_parents_ptr);
  a.out_scores = as_ptr<float>(out_scores_ptr);
  a.out_depth = as_ptr<std::int64_t>(out_depth_ptr);
  run_op(false, a, 0, best_first_tree_cpu, nullptr);
}

}  // namespace

void register_best_first_tree(py::module_& m) {
  m.def("best_first_tree", &best_first_tree, py::arg("probs_ptr"), py::arg("probs_dtype"), py::arg("tokens_ptr"),
        py::arg("tokens_dtype"), py::arg("batch"), py::arg("slots"), py::arg("k"), py::arg("nodes"),
        py::arg("out_tokens_ptr"), py::arg("out_parents_ptr"), py::arg("out_scores_ptr"), py::arg("out_depth_ptr"),
        R"doc(DDTree's best-first draft tree over per-slot candidates (CPU).

probs_ptr (probs_dtype 0 float32, 1 float16, 2 bfloat16) and tokens_ptr (tokens_dtype 0
int32, 1 int64): batch x slots x k, contiguous.  A node's score is its parent's (the root:
1) times its candidate's probability clamped to [0, 1] (NaN: 0), in float32.  Writes the
nodes = N best nodes (N <= k + k^2 + ... + k^slots) in max-heap pop order (popping pushes the
next-best sibling, then the best child; equal scores pop in push order), batch x nodes
each, contiguous: out_tokens int64, out_parents int64 (-1: a child of the root, else an
earlier column), out_scores float32, out_depth int64 (1 .. slots).)doc");
}

}  // namespace dspec
