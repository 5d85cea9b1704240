// pybind11 registration of merge_states.  Tensors cross as integer addresses; every
// argument is validated before anything is read or written (ValueError naming it).
#include "attention_bindings.h"

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "merge_states.h"

namespace py = pybind11;

namespace dspec {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("dspec._C.merge_states: " + msg); }

void check_ptr(std::int64_t p, const char* name, std::int64_t align) {
  if (p <= 0) fail(std::string(name) + " must be a non-null address");
  if (p % align) fail(std::string(name) + " must be " + std::to_string(align) + "-byte aligned");
}

void merge_states(std::int64_t o_a, std::int64_t lse_a, std::int64_t o_b, std::int64_t lse_b,
                  std::int64_t out, std::int64_t lse_out, int dtype, std::int64_t rows,
                  std::int64_t head_dim, const std::string& device, std::int64_t stream) {
  if (dtype != kFloat32 && dtype != kFloat16 && dtype != kBFloat16) fail("dtype code must be 0, 1 or 2");
  if (rows < 0) fail("rows must be >= 0");
  if (head_dim < 1) fail("head_dim must be >= 1");
  if (rows > 0 && head_dim > INT64_MAX / rows) fail("rows * head_dim overflows int64");
  const bool cuda = device == "cuda";
  if (!cuda && device != "cpu") fail("device must be 'cpu' or 'cuda', got '" + device + "'");
#ifndef DSPEC_WITH_CUDA
  if (cuda) throw std::invalid_argument("dspec._C was built without CUDA");
#endif
  if (rows == 0) return;
  const std::int64_t item = dtype == kFloat32 ? 4 : 2;
  check_ptr(o_a, "o_a", item);
  check_ptr(o_b, "o_b", item);
  check_ptr(out, "out", item);
  check_ptr(lse_a, "lse_a", 4);
  check_ptr(lse_b, "lse_b", 4);
  check_ptr(lse_out, "lse_out", 4);
  MergeStatesArgs args;
  args.o_a = reinterpret_cast<const void*>(o_a);
  args.lse_a = reinterpret_cast<const float*>(lse_a);
  args.o_b = reinterpret_cast<const void*>(o_b);
  args.lse_b = reinterpret_cast<const float*>(lse_b);
  args.out = reinterpret_cast<void*>(out);
  args.lse_out = reinterpret_cast<float*>(lse_out);
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
