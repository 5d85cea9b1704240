// pybind11 registration of topk_tokens / mass_candidates (topk.h).  Every argument is
// checked before anything is read or written (ValueError naming it).
#include "topk_bindings.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>

#include "checks.h"
#include "topk.h"

namespace py = pybind11;

namespace dspec {
namespace {

void topk(std::int64_t logits, int dtype, std::int64_t rows, std::int64_t vocab, std::int64_t row_stride,
          std::int64_t k, double temperature, double tau, std::int64_t tokens, std::int64_t values, std::int64_t count,
          int num_threads) {
  const Checker c{"topk"};
  c.float_dtype(dtype, "dtype");
  c.at_least(rows, 0, "rows");
  c.at_least(vocab, 1, "vocab");
  c.at_least(k, 1, "k");
  if (k > vocab) c.fail("k must be <= vocab");
  c.at_least(row_stride, vocab, "row_stride");
  c.product(rows, row_stride, "rows * row_stride");
  c.product(rows, k, "rows * k");
  if (!(temperature > 0.0) || !std::isfinite(temperature)) c.fail("temperature must be finite and > 0");
  if (!(tau >= 0.0 && tau <= 1.0)) c.fail("tau must be in [0, 1] (0: topk_tokens)");
  if (rows == 0) return;
  c.ptr(logits, "logits", element_size(dtype));
  c.ptr(tokens, "tokens", 8);
  c.ptr(values, "values", 4);
  if (tau > 0.0) c.ptr(count, "count", 8);
  TopkArgs a;
  a.logits = as_ptr<const void>(logits);
  a.dtype = dtype;
  a.rows = rows;
  a.vocab = vocab;
  a.row_stride = row_stride;
  a.k = k;
  a.inv_t = static_cast<float>(1.0 / temperature);
  a.mass = tau > 0.0;  // decided in double: a tiny tau rounds to 0.0f
  a.tau = static_cast<float>(tau);
  a.tokens = as_ptr<std::int64_t>(tokens);
  a.values = as_ptr<float>(values);
  a.count = tau > 0.0 ? as_ptr<std::int64_t>(count) : nullptr;
  a.num_threads = num_threads < 1 ? 1 : num_threads;
  py::gil_scoped_release release;
  topk_cpu(a);
}

}  // namespace

void register_topk(py::module_& m) {
  m.def("topk", &topk, py::arg("logits"), py::arg("dtype"), py::arg("rows"), py::arg("vocab"), py::arg("row_stride"),
        py::arg("k"), py::arg("temperature"), py::arg("tau"), py::arg("tokens"), py::arg("values"), py::arg("count"),
        py::arg("num_threads") = 1,
        R"doc(topk_tokens (tau = 0: tokens [rows, k] int64, values = probs [rows, k] float32) or
mass_candidates (tau in (0, 1]: values = logprobs, count [rows] int64) of logits [rows, vocab]
(dtype code 0 fp32, 1 fp16, 2 bf16, unit column stride).)doc");
}

}  // namespace dspec
