// pybind11 registration of merge_states and cascade_attention (CPU).  Tensors cross as
// integer addresses; every argument is validated before anything is read or written
// (ValueError naming it).
#include "attention_bindings.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "cascade_attention.h"
#include "checks.h"
#include "cpu_features.h"
#include "cpu_parallel.h"
#include "merge_states.h"

namespace py = pybind11;

namespace dspec {
namespace {

void merge_states(std::int64_t o_a, std::int64_t lse_a, std::int64_t o_b, std::int64_t lse_b, std::int64_t out,
                  std::int64_t lse_out, int dtype, std::int64_t rows, std::int64_t head_dim, const std::string& device,
                  std::int64_t stream, int num_threads) {
  const Checker c{"merge_states"};
  c.float_dtype(dtype, "dtype");
  c.at_least(rows, 0, "rows");
  c.at_least(head_dim, 0, "head_dim");
  c.product(rows, head_dim, "rows * head_dim");
  const bool cuda = c.device(device);
  if (rows == 0) return;
  const std::int64_t item = element_size(dtype);
  if (head_dim > 0) {  // D = 0: empty o tensors may report data_ptr() == 0 (never read)
    c.ptr(o_a, "o_a", item);
    c.ptr(o_b, "o_b", item);
    c.ptr(out, "out", item);
  }
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
  args.num_threads = caller_threads(num_threads);
  if (cuda) {
#ifdef DSPEC_WITH_CUDA
    merge_states_cuda(args, stream);
#endif
  } else {
    py::gil_scoped_release release;
    merge_states_cpu(args);
  }
}

// Largest element offset of a [n0, n1, n2, d] view with element strides s0, s1, s2 (unit
// stride along d), checked against int64 overflow; strides must be >= 0.
std::int64_t view_extent(const Checker& c, const char* name, std::int64_t n0, std::int64_t n1, std::int64_t n2,
                         std::int64_t d, std::int64_t s0, std::int64_t s1, std::int64_t s2) {
  const std::int64_t sizes[3] = {n0, n1, n2};
  const std::int64_t strides[3] = {s0, s1, s2};
  std::int64_t extent = d - 1;
  for (int i = 0; i < 3; ++i) {
    if (strides[i] < 0) c.fail(std::string(name) + " strides must be >= 0, got " + std::to_string(strides[i]));
    if (sizes[i] <= 1) continue;
    if (strides[i] > 0 && sizes[i] - 1 > (kI64Max - extent) / strides[i]) {
      c.fail(std::string(name) + ": the largest element offset overflows int64");
    }
    extent += (sizes[i] - 1) * strides[i];
  }
  return extent;
}

}  // namespace

bool cascade_args(const Checker& c, CascadeAttentionArgs& a, std::int64_t q, std::int64_t k, std::int64_t v,
                  std::int64_t out, std::int64_t lse, std::int64_t mask, std::int64_t prefix_k, std::int64_t prefix_v,
                  std::int64_t prefix_indptr, std::int64_t page_table, std::int64_t prefix_lens, int dtype,
                  std::int64_t batch, std::int64_t n, std::int64_t hq, std::int64_t hkv, std::int64_t head_dim,
                  double sm_scale, std::int64_t q_s0, std::int64_t q_s1, std::int64_t q_s2, std::int64_t k_s0,
                  std::int64_t k_s1, std::int64_t k_s2, std::int64_t v_s0, std::int64_t v_s1, std::int64_t v_s2,
                  std::int64_t o_s0, std::int64_t o_s1, std::int64_t o_s2, std::int64_t mask_s0, std::int64_t mask_s1,
                  std::int64_t pk_s0, std::int64_t pk_s1, std::int64_t pk_s2, std::int64_t pv_s0, std::int64_t pv_s1,
                  std::int64_t pv_s2, int indptr_dtype, std::int64_t prefix_rows, std::int64_t page_size,
                  std::int64_t max_pages, std::int64_t page_table_stride, int num_threads, const std::string& isa) {
  c.float_dtype(dtype, "dtype");
  c.at_least(batch, 0, "batch");
  c.at_least(n, 0, "n");
  c.at_least(hkv, 1, "hkv");
  c.at_least(hq, 1, "hq");
  if (hq % hkv != 0) c.fail("hq (" + std::to_string(hq) + ") must be a multiple of hkv (" + std::to_string(hkv) + ")");
  c.at_least(head_dim, 1, "head_dim");
  if (!std::isfinite(sm_scale) || !std::isfinite(static_cast<float>(sm_scale))) {
    c.fail("sm_scale must be finite (as float32), got " + std::to_string(sm_scale));
  }
  a.isa = c.isa(isa, cascade_attention_has_avx512(), "a CPU with AVX512F/BW/VL and FMA",  // CascadeIsa codes
                cascade_attention_has_amx(kBFloat16, 64), "a CPU with AMX-BF16 that the kernel enables",
                cpu::has_avx2(), "a CPU with AVX2, FMA and F16C");
  // element offsets of every view fit in int64 (also for the outputs and the mask)
  view_extent(c, "q", batch, n, hq, head_dim, q_s0, q_s1, q_s2);
  view_extent(c, "k", batch, n, hkv, head_dim, k_s0, k_s1, k_s2);
  view_extent(c, "v", batch, n, hkv, head_dim, v_s0, v_s1, v_s2);
  view_extent(c, "out", batch, n, hq, head_dim, o_s0, o_s1, o_s2);
  c.product(batch, n, "batch * n");
  c.product(batch * n, hq, "batch * n * hq");
  const std::int64_t words = (n + 31) / 32;
  if (mask != 0) view_extent(c, "mask", batch, n, 1, words, mask_s0, mask_s1, 0);
  const bool ragged = prefix_indptr != 0, paged = page_table != 0 || prefix_lens != 0;
  if (ragged && paged) c.fail("give either prefix_indptr (ragged) or page_table + prefix_lens (paged), not both");
  if (!(ragged || paged) && (prefix_k != 0 || prefix_v != 0)) {
    c.fail("prefix_k and prefix_v go with prefix_indptr or page_table + prefix_lens");
  }
  if (paged && (page_table == 0 || prefix_lens == 0)) c.fail("a paged prefix needs page_table and prefix_lens");
  if (batch == 0 || n == 0) return false;
  const std::int64_t item = element_size(dtype);
  c.ptr(q, "q", item);
  c.ptr(k, "k", item);
  c.ptr(v, "v", item);
  c.ptr(out, "out", item);
  c.optional_ptr(lse, "lse", 4);
  c.optional_ptr(mask, "mask", 4);

  a.dtype = dtype;
  a.batch = batch;
  a.n = n;
  a.hq = hq;
  a.hkv = hkv;
  a.head_dim = head_dim;
  a.sm_scale = static_cast<float>(sm_scale);
  a.q = as_ptr<const void>(q);
  a.k = as_ptr<const void>(k);
  a.v = as_ptr<const void>(v);
  a.out = as_ptr<void>(out);
  a.lse = as_ptr<float>(lse);
  a.mask = as_ptr<const std::int32_t>(mask);
  const std::int64_t qs[3] = {q_s0, q_s1, q_s2}, ks[3] = {k_s0, k_s1, k_s2}, vs[3] = {v_s0, v_s1, v_s2};
  const std::int64_t os[3] = {o_s0, o_s1, o_s2};
  for (int i = 0; i < 3; ++i) {
    a.q_stride[i] = qs[i];
    a.k_stride[i] = ks[i];
    a.v_stride[i] = vs[i];
    a.out_stride[i] = os[i];
  }
  a.mask_stride[0] = mask_s0;
  a.mask_stride[1] = mask_s1;

  if (ragged || paged) {
    c.at_least(prefix_rows, 0, ragged ? "prefix_rows" : "num_pages");
    // an empty prefix tensor may have no address; its metadata must then select no row
    if (prefix_rows > 0 || prefix_k != 0 || prefix_v != 0) {
      c.ptr(prefix_k, "prefix_k", item);
      c.ptr(prefix_v, "prefix_v", item);
    }
    a.prefix_k = as_ptr<const void>(prefix_k);
    a.prefix_v = as_ptr<const void>(prefix_v);
    const std::int64_t pks[3] = {pk_s0, pk_s1, pk_s2}, pvs[3] = {pv_s0, pv_s1, pv_s2};
    for (int i = 0; i < 3; ++i) {
      a.prefix_k_stride[i] = pks[i];
      a.prefix_v_stride[i] = pvs[i];
    }
    if (ragged) {
      c.id_dtype(indptr_dtype, "indptr_dtype");
      c.ptr(prefix_indptr, "prefix_indptr", id_size(indptr_dtype));
      a.prefix = kPrefixRagged;
      a.prefix_indptr = as_ptr<const void>(prefix_indptr);
      a.indptr_dtype = indptr_dtype;
      view_extent(c, "prefix_k", 1, prefix_rows, hkv, head_dim, 0, pk_s1, pk_s2);
      view_extent(c, "prefix_v", 1, prefix_rows, hkv, head_dim, 0, pv_s1, pv_s2);
      // the values: 0 <= indptr[b] <= indptr[b + 1] <= prefix_rows
      std::int64_t prev = 0;
      for (std::int64_t b = 0; b <= batch; ++b) {
        const std::int64_t x = indptr_dtype == kInt64 ? as_ptr<const std::int64_t>(prefix_indptr)[b]
                                                      : as_ptr<const std::int32_t>(prefix_indptr)[b];
        if (x < prev || x > prefix_rows) {
          c.fail("prefix_indptr must be non-negative, never decrease and end at most at prefix_rows (" +
                 std::to_string(prefix_rows) + "); entry " + std::to_string(b) + " is " + std::to_string(x));
        }
        prev = x;
      }
    } else {
      c.ptr(page_table, "page_table", 4);
      c.ptr(prefix_lens, "prefix_lens", 4);
      c.at_least(page_size, 1, "page_size");
      c.at_least(max_pages, 0, "max_pages");
      c.at_least(page_table_stride, 0, "page_table_stride");
      c.product(max_pages, page_size, "max_pages * page_size");
      view_extent(c, "page_table", 1, batch, 1, max_pages, 0, page_table_stride, 0);
      view_extent(c, "prefix_k", prefix_rows, page_size, hkv, head_dim, pk_s0, pk_s1, pk_s2);
      view_extent(c, "prefix_v", prefix_rows, page_size, hkv, head_dim, pv_s0, pv_s1, pv_s2);
      a.prefix = kPrefixPaged;
      a.page_table = as_ptr<const std::int32_t>(page_table);
      a.page_table_stride = page_table_stride;
      a.prefix_lens = as_ptr<const std::int32_t>(prefix_lens);
      a.page_size = page_size;
      // the values: lens in [0, max_pages * page_size], every page used is in [0, num_pages)
      for (std::int64_t b = 0; b < batch; ++b) {
        const std::int64_t len = a.prefix_lens[b];
        if (len < 0 || len > max_pages * page_size) {
          c.fail("prefix_lens[" + std::to_string(b) + "] = " + std::to_string(len) + " is not in [0, max_pages * " +
                 "page_size] = [0, " + std::to_string(max_pages * page_size) + "]");
        }
        const std::int32_t* row = a.page_table + b * page_table_stride;
        for (std::int64_t p = 0; p * page_size < len; ++p) {
          if (row[p] < 0 || row[p] >= prefix_rows) {
            c.fail("page_table[" + std::to_string(b) + ", " + std::to_string(p) + "] = " + std::to_string(row[p]) +
                   " is not a page in [0, " + std::to_string(prefix_rows) + ")");
          }
        }
      }
    }
  }
  a.num_threads = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(num_threads, cpu::max_threads())));
  return true;
}

namespace {

void cascade_attention(std::int64_t q, std::int64_t k, std::int64_t v, std::int64_t out, std::int64_t lse,
                       std::int64_t mask, std::int64_t prefix_k, std::int64_t prefix_v, std::int64_t prefix_indptr,
                       std::int64_t page_table, std::int64_t prefix_lens, int dtype, std::int64_t batch, std::int64_t n,
                       std::int64_t hq, std::int64_t hkv, std::int64_t head_dim, double sm_scale, std::int64_t q_s0,
                       std::int64_t q_s1, std::int64_t q_s2, std::int64_t k_s0, std::int64_t k_s1, std::int64_t k_s2,
                       std::int64_t v_s0, std::int64_t v_s1, std::int64_t v_s2, std::int64_t o_s0, std::int64_t o_s1,
                       std::int64_t o_s2, std::int64_t mask_s0, std::int64_t mask_s1, std::int64_t pk_s0,
                       std::int64_t pk_s1, std::int64_t pk_s2, std::int64_t pv_s0, std::int64_t pv_s1,
                       std::int64_t pv_s2, int indptr_dtype, std::int64_t prefix_rows, std::int64_t page_size,
                       std::int64_t max_pages, std::int64_t page_table_stride, int num_threads,
                       const std::string& isa) {
  const Checker c{"cascade_attention"};
  CascadeAttentionArgs a;
  if (!cascade_args(c, a, q, k, v, out, lse, mask, prefix_k, prefix_v, prefix_indptr, page_table, prefix_lens, dtype,
                    batch, n, hq, hkv, head_dim, sm_scale, q_s0, q_s1, q_s2, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, o_s0,
                    o_s1, o_s2, mask_s0, mask_s1, pk_s0, pk_s1, pk_s2, pv_s0, pv_s1, pv_s2, indptr_dtype, prefix_rows,
                    page_size, max_pages, page_table_stride, num_threads, isa)) {
    return;
  }
  py::gil_scoped_release release;
  cascade_attention_cpu(a);
}

}  // namespace

void register_attention(py::module_& m) {
  m.def("merge_states", &merge_states, py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"), py::arg("lse_b"),
        py::arg("out"), py::arg("lse_out"), py::arg("dtype"), py::arg("rows"), py::arg("head_dim"), py::arg("device"),
        py::arg("stream") = 0, py::arg("num_threads") = 0,
        R"doc(Merge two partial attention states: o [rows, head_dim] (dtype code 0 fp32, 1 fp16,
2 bf16, contiguous; head_dim 0 merges only the lse) with lse [rows] float32 each, into out /
lse_out.  num_threads: CPU threads at most (0: dspec.cpu.kernel_threads()).  Raises ValueError for a
bad argument, RuntimeError when a CUDA launch fails.)doc");
  m.def("cascade_attention", &cascade_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("mask"), py::arg("prefix_k"), py::arg("prefix_v"), py::arg("prefix_indptr"),
        py::arg("page_table"), py::arg("prefix_lens"), py::arg("dtype"), py::arg("batch"), py::arg("n"), py::arg("hq"),
        py::arg("hkv"), py::arg("head_dim"), py::arg("sm_scale"), py::arg("q_s0"), py::arg("q_s1"), py::arg("q_s2"),
        py::arg("k_s0"), py::arg("k_s1"), py::arg("k_s2"), py::arg("v_s0"), py::arg("v_s1"), py::arg("v_s2"),
        py::arg("out_s0"), py::arg("out_s1"), py::arg("out_s2"), py::arg("mask_s0"), py::arg("mask_s1"),
        py::arg("prefix_k_s0"), py::arg("prefix_k_s1"), py::arg("prefix_k_s2"), py::arg("prefix_v_s0"),
        py::arg("prefix_v_s1"), py::arg("prefix_v_s2"), py::arg("indptr_dtype"), py::arg("prefix_rows"),
        py::arg("page_size"), py::arg("max_pages"), py::arg("page_table_stride"), py::arg("num_threads"),
        py::arg("isa") = "auto",
        R"doc(cascade_attention on CPU tensors (flash-style online softmax, fp32 state).

Addresses (0 = absent): q [B, N, Hq, D], k / v [B, N, Hkv, D], out [B, N, Hq, D] (dtype code
0 fp32, 1 fp16, 2 bf16, unit stride along D, element strides *_s0.._s2 for batch, token,
head); lse float32 [B, N, Hq] contiguous (0: not computed); mask int32 words [.., N,
ceil(N/32)] with strides mask_s0 (batch, 0 = shared) and mask_s1 (row), 0: all visible.
Prefix, either ragged: prefix_k / prefix_v rows [T, Hkv, D] (strides: s0 unused, s1 row, s2
head), prefix_indptr [B + 1] (indptr_dtype 0 int32, 1 int64), prefix_rows = T; or paged:
prefix_k / prefix_v [num_pages, page_size, Hkv, D] (strides page, row, head), page_table
int32 [B, max_pages] (page_table_stride entries between requests), prefix_lens int32 [B],
prefix_rows = num_pages.  sm_scale multiplies q.k; a query that sees no key gets out = 0,
lse = -inf.  num_threads: at most this many threads (and DSPEC_CPU_THREADS), small calls
run on the calling thread; the result does not depend on it.  isa: 'auto', 'generic'
(portable loops), 'avx2' (AVX2 + FMA tiles), 'avx512' or 'amx' (AMX-BF16 tiles for bf16 with head_dim a multiple of 32,
the AVX-512 tiles for other inputs; 'auto' picks it where the CPU has it; its bits differ
from the AVX-512 tiles').  The GIL is released while it runs.  Raises ValueError for a
bad argument (including prefix indptr / lengths / page ids out of range).)doc");
  m.def(
      "cascade_attention_isa",
      [](int dtype, std::int64_t head_dim) {
        if (dtype >= 0 && cascade_attention_has_amx(dtype, head_dim)) return std::string("amx");
        return std::string(cascade_attention_has_avx512() ? "avx512" : cpu::has_avx2() ? "avx2" : "generic");
      },
      py::arg("dtype") = -1, py::arg("head_dim") = 64,
      "The tile code cascade_attention runs on this CPU with isa='auto' for inputs of this dtype code (0 fp32, "
      "1 fp16, 2 bf16) and head_dim: 'amx', 'avx512', 'avx2' or 'generic' (within $DSPEC_CPU_ISA); without a "
      "dtype, the code of float32 inputs.");
}

}  // namespace dspec
