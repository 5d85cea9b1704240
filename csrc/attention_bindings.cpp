// pybind11 registration of merge_states.  Tensors cross as integer addresses; every
// argument is validated before anything is read or written (ValueError naming it).
#include "attention_bindings.h"

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "checks.h"
#include "merge_states.h"

namespace py = pybind11;

namespace dspec {
namespace {

void merge_states(std::int64_t o_a, std::int64_t lse_a, std::int64_t o_b, std::int64_t lse_b,
                  std::int64_t out, std::int64_t lse_out, int dtype, std::int64_t rows,
                  std::int64_t head_dim, const std::string& device, std::int64_t stream) {
  const Checker c{"merge_states"};
  c.float_dtype(dtype, "dtype");
  c.at_least(rows, 0, "rows");
  c.at_least(head_dim, 1, "head_dim");
  c.product(rows, head_dim, "rows * head_dim");
  const bool cuda = c.device(device);
  if (rows == 0) return;
  const std::int64_t item = element_size(dtype);
  c.ptr(o_a, "o_a", item);
  c.ptr(o_b, "o_b", item);
  c.ptr(out, "out", item);
  c.ptr(lse_a, "lse_a", 4);
  c.ptr(lse_b, "lse_b", 4);
  c.ptr(lse_out, "lse_out", 4);
  MergeStatesArgs args;
  args.o_a = as_ptr<const void>(o_a);
  args.lse_a = as_ptr<const float>(lse_a);
  args.o_b = as_ptr<const void>(o_b);
  args.lse_b = as_ptr<const float>(lse_b);
  args.out = as_ptr<void>(out);
  args.lse_out = as_ptr<float>(lse_out);
  args.dtype = dtype;
  args.rows = rows;
  args.head_dim = head_dim;
  if (cuda) {
#ifdef DSPEC_WITH_CUDA
    merge_states_cuda(args, stream);
#endif
  } else {
    py::gil_scoped_release release;
    merge_states_cpu(args);
  }
}

}  // namespace

void register_attention(py::module_& m) {
  m.def("merge_states", &merge_states, py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"), py::arg("lse_b"),
        py::arg("out"), py::arg("lse_out"), py::arg("dtype"), py::arg("rows"), py::arg("head_dim"),
        py::arg("device"), py::arg("stream") = 0,
        R"doc(Merge two partial attention states: o [rows, head_dim] (dtype code 0 fp32, 1 fp16,
2 bf16, contiguous) with lse [rows] float32 each, into out / lse_out.  Raises ValueError for a
bad argument, RuntimeError when a CUDA launch fails.)doc");
}

}  // namespace dspec
