// pybind11 registration of the fused layer ops (layer_ops.h).  Every argument is checked
// before anything is read or written (ValueError naming it).
#include "layer_ops_bindings.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "checks.h"
#include "layer_ops.h"

namespace py = pybind11;

namespace dspec {
namespace {

void rms_norm(std::int64_t x, std::int64_t weight, std::int64_t out, int dtype, std::int64_t rows, std::int64_t hidden,
              double eps, int num_threads) {
  const Checker c{"rms_norm"};
  c.float_dtype(dtype, "dtype");
  c.at_least(rows, 0, "rows");
  c.at_least(hidden, 1, "hidden");
  c.product(rows, hidden, "rows * hidden");
  if (!(eps >= 0.0)) c.fail("eps must be >= 0");
  if (rows == 0) return;
  const std::int64_t item = element_size(dtype);
  c.ptr(x, "x", item);
  c.ptr(weight, "weight", item);
  c.ptr(out, "out", item);
  RmsNormArgs a;
  a.dtype = dtype;
  a.rows = rows;
  a.hidden = hidden;
  a.eps = static_cast<float>(eps);
  a.x = as_ptr<const void>(x);
  a.weight = as_ptr<const void>(weight);
  a.out = as_ptr<void>(out);
  a.num_threads = num_threads < 1 ? 1 : num_threads;
  py::gil_scoped_release release;
  rms_norm_cpu(a);
}

void rope(std::int64_t q, std::int64_t k, std::int64_t cos, std::int64_t sin, int dtype, std::int64_t rows,
          std::int64_t hq, std::int64_t hkv, std::int64_t head_dim, int num_threads) {
  const Checker c{"rope"};
  c.float_dtype(dtype, "dtype");
  c.at_least(rows, 0, "rows");
  c.at_least(hq, 1, "hq");
  c.at_least(hkv, 0, "hkv");  // 0: rotate q alone (k unused)
  check_rope_head_dim(c, head_dim);
  c.product(rows, hq * head_dim, "rows * hq * head_dim");
  if (rows == 0) return;
  const std::int64_t item = element_size(dtype);
  c.ptr(q, "q", item);
  if (hkv > 0) c.ptr(k, "k", item);
  c.ptr(cos, "cos", 4);
  c.ptr(sin, "sin", 4);
  RopeArgs a;
  a.dtype = dtype;
  a.rows = rows;
  a.hq = hq;
  a.hkv = hkv;
  a.head_dim = head_dim;
  a.q = as_ptr<void>(q);
  a.k = as_ptr<void>(k);
  a.cos = as_ptr<const float>(cos);
  a.sin = as_ptr<const float>(sin);
  a.num_threads = num_threads < 1 ? 1 : num_threads;
  py::gil_scoped_release release;
  rope_cpu(a);
}

void copy_rows(std::int64_t src, std::int64_t dst, std::int64_t groups, std::int64_t src_group_stride,
               std::int64_t dst_group_stride, std::int64_t src_group_rows, std::int64_t dst_group_rows,
               std::int64_t rows, std::int64_t src_rows, std::int64_t dst_rows, std::int64_t row_bytes,
               int num_threads) {
  const Checker c{"copy_rows"};
  c.at_least(groups, 0, "groups");
  c.at_least(rows, 0, "rows");
  c.at_least(row_bytes, 1, "row_bytes");
  c.at_least(src_group_rows, 0, "src_group_rows");
  c.at_least(dst_group_rows, 0, "dst_group_rows");
  c.at_least(src_group_stride, 0, "src_group_stride");
  c.at_least(dst_group_stride, 0, "dst_group_stride");
  c.product(src_group_rows, row_bytes, "src_group_rows * row_bytes");
  c.product(dst_group_rows, row_bytes, "dst_group_rows * row_bytes");
  c.product(groups, std::max(src_group_stride, dst_group_stride), "groups * group stride");
  if (src_group_stride < src_group_rows * row_bytes && groups > 1) c.fail("src_group_stride overlaps the groups");
  if (dst_group_stride < dst_group_rows * row_bytes && groups > 1) c.fail("dst_group_stride overlaps the groups");
  if (groups == 0 || rows == 0) return;
  c.ptr(src, "src", 1);
  c.ptr(dst, "dst", 1);
  c.ptr(src_rows, "src_rows", 8);
  c.ptr(dst_rows, "dst_rows", 8);
  const auto* si = as_ptr<const std::int64_t>(src_rows);
  const auto* di = as_ptr<const std::int64_t>(dst_rows);
  for (std::int64_t i = 0; i < rows; ++i) {  // every index in range before any byte moves
    if (si[i] < 0 || si[i] >= src_group_rows) {
      c.fail("src_rows[" + std::to_string(i) + "] = " + std::to_string(si[i]) + " is outside [0, " +
             std::to_string(src_group_rows) + ")");
    }
    if (di[i] < 0 || di[i] >= dst_group_rows) {
      c.fail("dst_rows[" + std::to_string(i) + "] = " + std::to_string(di[i]) + " is outside [0, " +
             std::to_string(dst_group_rows) + ")");
    }
  }
  CopyRowsArgs a;
  a.src = as_ptr<const char>(src);
  a.dst = as_ptr<char>(dst);
  a.groups = groups;
  a.src_group_stride = src_group_stride;
  a.dst_group_stride = dst_group_stride;
  a.rows = rows;
  a.src_rows = si;
  a.dst_rows = di;
  a.row_bytes = row_bytes;
  a.num_threads = num_threads < 1 ? 1 : num_threads;
  py::gil_scoped_release release;
  copy_rows_cpu(a);
}

// A KV commit: slot j of request b (keep[b, j] >= 0, a row of the request's n suffix rows)
// to row lengths[b] + j of its cache, in every layer, for K and V; slots of -1 are skipped.
void commit_rows(std::int64_t src_k, std::int64_t src_v, std::int64_t dst_k, std::int64_t dst_v, std::int64_t groups,
                 std::int64_t src_group_stride, std::int64_t dst_group_stride, std::int64_t batch, std::int64_t n,
                 std::int64_t capacity, std::int64_t keep, std::int64_t slots, std::int64_t lengths,
                 std::int64_t row_bytes, int num_threads) {
  const Checker c{"commit_rows"};
  c.at_least(groups, 0, "groups");
  c.at_least(batch, 0, "batch");
  c.at_least(n, 0, "n");
  c.at_least(capacity, 0, "capacity");
  c.at_least(slots, 0, "slots");
  c.at_least(row_bytes, 1, "row_bytes");
  c.at_least(src_group_stride, 0, "src_group_stride");
  c.at_least(dst_group_stride, 0, "dst_group_stride");
  c.product(batch, std::max(n, capacity), "batch * rows");
  c.product(batch * std::max(n, capacity), row_bytes, "batch * rows * row_bytes");
  c.product(groups, std::max(src_group_stride, dst_group_stride), "groups * group stride");
  if (groups > 1 && src_group_stride < batch * n * row_bytes) c.fail("src_group_stride overlaps the groups");
  if (groups > 1 && dst_group_stride < batch * capacity * row_bytes) c.fail("dst_group_stride overlaps the groups");
  if (groups == 0 || batch == 0 || slots == 0) return;
  c.ptr(keep, "keep", 8);
  c.ptr(lengths, "lengths", 8);
  const auto* kp = as_ptr<const std::int64_t>(keep);
  const auto* len = as_ptr<const std::int64_t>(lengths);
  std::vector<std::int64_t> src_rows, dst_rows;
  src_rows.reserve(static_cast<std::size_t>(batch * slots));
  dst_rows.reserve(static_cast<std::size_t>(batch * slots));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t j = 0; j < slots; ++j) {  // every index in range before any byte moves
      const std::int64_t i = kp[b * slots + j];
      if (i < 0) continue;
      if (i >= n)
        c.fail("keep[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(i) +
               " is outside [-1, " + std::to_string(n) + ")");
      if (len[b] < 0 || len[b] + j >= capacity) {
        c.fail("lengths[" + std::to_string(b) + "] + " + std::to_string(j) + " is outside the capacity " +
               std::to_string(capacity));
      }
      src_rows.push_back(b * n + i);
      dst_rows.push_back(b * capacity + len[b] + j);
    }
  }
  if (src_rows.empty()) return;
  c.ptr(src_k, "src_k", 1);
  c.ptr(src_v, "src_v", 1);
  c.ptr(dst_k, "dst_k", 1);
  c.ptr(dst_v, "dst_v", 1);
  CopyRowsArgs a;
  a.groups = groups;
  a.src_group_stride = src_group_stride;
  a.dst_group_stride = dst_group_stride;
  a.rows = static_cast<std::int64_t>(src_rows.size());
  a.src_rows = src_rows.data();
  a.dst_rows = dst_rows.data();
  a.row_bytes = row_bytes;
  a.num_threads = num_threads < 1 ? 1 : num_threads;
  py::gil_scoped_release release;
  for (int half = 0; half < 2; ++half) {
    a.src = as_ptr<const char>(half ? src_v : src_k);
    a.dst = as_ptr<char>(half ? dst_v : dst_k);
    copy_rows_cpu(a);
  }
}

}  // namespace

void register_layer_ops(py::module_& m) {
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("dtype"), py::arg("rows"),
        py::arg("hidden"), py::arg("eps"), py::arg("num_threads") = 1,
        R"doc(out = weight * rmsnorm(x) over rows of `hidden` contiguous elements (dtype code 0 fp32,
1 fp16, 2 bf16), math in float32.)doc");
  m.def("rope", &rope, py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("dtype"), py::arg("rows"),
        py::arg("hq"), py::arg("hkv"), py::arg("head_dim"), py::arg("num_threads") = 1,
        R"doc(Rotate-half RoPE in place on q [rows, hq, D] and k [rows, hkv, D] (contiguous) with
float32 tables cos / signed sin [rows, D].)doc");
  m.def("copy_rows", &copy_rows, py::arg("src"), py::arg("dst"), py::arg("groups"), py::arg("src_group_stride"),
        py::arg("dst_group_stride"), py::arg("src_group_rows"), py::arg("dst_group_rows"), py::arg("rows"),
        py::arg("src_rows"), py::arg("dst_rows"), py::arg("row_bytes"), py::arg("num_threads") = 1,
        R"doc(For every group g < groups: destination row dst_rows[i] = source row src_rows[i]
(row_bytes bytes each; int64 index arrays of `rows` entries, checked against
src_group_rows / dst_group_rows). Group strides in bytes. The KV cache's commit.)doc");
  m.def("commit_rows", &commit_rows, py::arg("src_k"), py::arg("src_v"), py::arg("dst_k"), py::arg("dst_v"),
        py::arg("groups"), py::arg("src_group_stride"), py::arg("dst_group_stride"), py::arg("batch"), py::arg("n"),
        py::arg("capacity"), py::arg("keep"), py::arg("slots"), py::arg("lengths"), py::arg("row_bytes"),
        py::arg("num_threads") = 1,
        R"doc(The KV cache's commit in one call: for every group (layer) g, slot j of request b with
keep[b, j] >= 0 (int64 [batch, slots]; -1 skipped) copies source row b * n + keep[b, j]
(src_k / src_v) to destination row b * capacity + lengths[b] + j (dst_k / dst_v; lengths
int64 [batch]), row_bytes each; group strides in bytes; indices checked first.)doc");
}

}  // namespace dspec
