// pybind11 registration of the small-row linear layer (linear.h).  Every argument is
// checked before anything is read or written (ValueError naming it).
#include "linear_bindings.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "checks.h"
#include "linear.h"
#include "mask_lora.h"

namespace py = pybind11;

namespace dspec {
namespace {

// The arguments of one projection (addresses already checked; bias 0 for none).
LinearArgs part(int dtype, std::int64_t m, std::int64_t k, std::int64_t x, std::int64_t ldx, std::int64_t weight,
                std::int64_t bias, std::int64_t out, std::int64_t n, std::int64_t ldo, int num_threads) {
  LinearArgs a;
  a.dtype = dtype;
  a.m = m;
  a.k = k;
  a.n = n;
  a.ldx = ldx;
  a.ldo = ldo;
  a.x = as_ptr<const void>(x);
  a.weight = as_ptr<const void>(weight);
  a.bias = bias == 0 ? nullptr : as_ptr<const void>(bias);
  a.out = as_ptr<void>(out);
  a.num_threads = num_threads < 1 ? 1 : num_threads;
  return a;
}

std::int64_t packed_size(std::int64_t n, std::int64_t k, int dtype) {
  const Checker c{"linear_packed_size"};
  c.float_dtype(dtype, "dtype");
  c.at_least(n, 0, "n");
  c.at_least(k, 1, "k");
  c.product(n + kPanel, k + 1, "n * k");
  return linear_packed_elements(n, k, dtype);
}

void pack(std::int64_t weight, std::int64_t packed, int dtype, std::int64_t n, std::int64_t k, std::int64_t ldw,
          int num_threads) {
  const Checker c{"linear_pack"};
  packed_size(n, k, dtype);
  c.at_least(ldw, k, "ldw");
  c.product(n, ldw, "n * ldw");
  if (n == 0) return;
  const std::int64_t item = element_size(dtype);
  c.ptr(weight, "weight", item);
  c.ptr(packed, "packed", item);
  LinearPackArgs a;
  a.dtype = dtype;
  a.n = n;
  a.k = k;
  a.ldw = ldw;
  a.weight = as_ptr<const void>(weight);
  a.packed = as_ptr<void>(packed);
  a.num_threads = num_threads < 1 ? 1 : num_threads;
  py::gil_scoped_release release;
  linear_pack_cpu(a);
}

void linear(std::int64_t x, std::int64_t weight, std::int64_t bias, std::int64_t out, int dtype, std::int64_t m,
            std::int64_t k, std::int64_t n, std::int64_t ldx, std::int64_t ldo, int num_threads,
            const std::string& isa) {
  const Checker c{"linear"};
  c.float_dtype(dtype, "dtype");
  c.at_least(m, 0, "m");
  c.at_least(k, 1, "k");
  c.at_least(n, 0, "n");
  c.at_least(ldx, k, "ldx");
  c.at_least(ldo, n, "ldo");
  c.product(m, ldx, "m * ldx");
  c.product(n + kPanel, k + 1, "n * k");
  c.product(m, ldo, "m * ldo");
  const int code = c.isa(isa, linear_has_avx512(dtype),  // LinearIsa codes
                         "float32 / bfloat16 and a CPU with AVX-512 (AVX512_BF16 for bfloat16)", linear_has_amx(dtype),
                         "bfloat16 and a CPU with AMX-BF16 that the kernel enables", linear_has_avx2(dtype),
                         "a CPU with AVX2, FMA and F16C");
  if (m == 0 || n == 0) return;
  const std::int64_t item = element_size(dtype);
  c.ptr(x, "x", item);
  c.ptr(weight, "weight", item);
  c.optional_ptr(bias, "bias", item);
  c.ptr(out, "out", item);
  LinearArgs a = part(dtype, m, k, x, ldx, weight, bias, out, n, ldo, num_threads);
  a.isa = code;
  py::gil_scoped_release release;
  linear_cpu(a);
}

void linear_group(std::int64_t x, int dtype, std::int64_t m, std::int64_t k, const std::vector<std::int64_t>& weights,
                  const std::vector<std::int64_t>& biases, const std::vector<std::int64_t>& outs,
                  const std::vector<std::int64_t>& ns, int num_threads) {
  const Checker c{"linear_group"};
  c.float_dtype(dtype, "dtype");
  c.at_least(m, 0, "m");
  c.at_least(k, 1, "k");
  const std::size_t count = weights.size();
  if (count == 0 || count > 8) c.fail("weights must hold 1 to 8 addresses, got " + std::to_string(count));
  if (biases.size() != count || outs.size() != count || ns.size() != count) {
    c.fail("weights, biases, outs and ns must have the same length");
  }
  c.product(m, k, "m * k");
  const std::int64_t item = element_size(dtype);
  std::vector<LinearArgs> parts(count);
  for (std::size_t p = 0; p < count; ++p) {
    const std::string at = "[" + std::to_string(p) + "]";
    c.at_least(ns[p], 1, ("ns" + at).c_str());
    c.product(ns[p] + kPanel, k + 1, ("ns" + at + " * k").c_str());
    c.product(m, ns[p], ("m * ns" + at).c_str());
    if (m > 0) {
      c.ptr(weights[p], ("weights" + at).c_str(), item);
      c.optional_ptr(biases[p], ("biases" + at).c_str(), item);
      c.ptr(outs[p], ("outs" + at).c_str(), item);
    }
    parts[p] = part(dtype, m, k, x, k, weights[p], biases[p], outs[p], ns[p], ns[p], num_threads);
  }
  if (m == 0) return;
  c.ptr(x, "x", item);
  py::gil_scoped_release release;
  linear_group_cpu(parts.data(), static_cast<int>(count));
}

void mask_lora(std::int64_t y, std::int64_t x, std::int64_t rows, std::int64_t a, std::int64_t bt, double scale,
               int dtype, std::int64_t num_rows, std::int64_t total_rows, std::int64_t k, std::int64_t n,
               std::int64_t rank, int num_threads, int weight_dtype, const std::string& isa, std::int64_t packed) {
  const Checker c{"mask_lora"};
  c.float_dtype(dtype, "dtype");
  const int which = c.isa(isa, mask_lora_has_avx512(dtype), "AVX-512 (F, BW, VL) and a float32 or bfloat16 dtype",
                          mask_lora_has_amx(dtype, rank) && packed != 0,
                          "AMX-BF16, a bfloat16 dtype, rank <= 16 and the packed adapter (packed)");
  if (weight_dtype != kFloat32 && weight_dtype != kBFloat16) {
    c.fail("weight_dtype must be 0 (float32) or 2 (bfloat16), got " + std::to_string(weight_dtype));
  }
  c.at_least(num_rows, 0, "num_rows");
  c.at_least(total_rows, 0, "total_rows");
  c.at_least(k, 1, "k");
  c.at_least(n, 1, "n");
  c.at_least(rank, 1, "rank");
  c.product(total_rows, k, "total_rows * k");
  c.product(total_rows, n, "total_rows * n");
  c.product(rank, k, "rank * k");
  c.product(rank, n, "rank * n");
  if (num_rows == 0) return;
  const std::int64_t item = element_size(dtype);
  c.ptr(y, "y", item);
  c.ptr(x, "x", item);
  c.ptr(rows, "rows", 8);
  const std::int64_t witem = element_size(weight_dtype);
  c.ptr(a, "a", witem);
  c.ptr(bt, "bt", witem);
  c.optional_ptr(packed, "packed", 2);
  const std::int64_t* r = as_ptr<const std::int64_t>(rows);
  for (std::int64_t i = 0; i < num_rows; ++i) {
    if (r[i] < 0 || r[i] >= total_rows) {
      c.fail("rows must lie in [0, total_rows = " + std::to_string(total_rows) + "), got " + std::to_string(r[i]));
    }
  }
  MaskLoraArgs m;
  m.dtype = dtype;
  m.num_rows = num_rows;
  m.k = k;
  m.n = n;
  m.rank = rank;
  m.rows = r;
  m.x = as_ptr<const void>(x);
  m.weight_dtype = weight_dtype;
  m.a = as_ptr<const void>(a);
  m.bt = as_ptr<const void>(bt);
  m.scale = static_cast<float>(scale);
  m.y = as_ptr<void>(y);
  m.num_threads = std::max(1, num_threads);
  m.isa = which;
  m.packed = packed == 0 ? nullptr : as_ptr<const void>(packed);
  py::gil_scoped_release release;
  mask_lora_cpu(m);
}

void mask_lora_pack(std::int64_t a, std::int64_t bt, std::int64_t packed, std::int64_t rank, std::int64_t k,
                    std::int64_t n, int weight_dtype) {
  const Checker c{"mask_lora_pack"};
  if (weight_dtype != kFloat32 && weight_dtype != kBFloat16) {
    c.fail("weight_dtype must be 0 (float32) or 2 (bfloat16), got " + std::to_string(weight_dtype));
  }
  c.at_least(rank, 1, "rank");
  if (rank > kMaskLoraAmxRank)
    c.fail("rank must be <= " + std::to_string(kMaskLoraAmxRank) + ", got " + std::to_string(rank));
  c.at_least(k, 1, "k");
  c.at_least(n, 1, "n");
  c.product(rank, k, "rank * k");
  c.product(rank, n, "rank * n");
  const std::int64_t witem = element_size(weight_dtype);
  c.ptr(a, "a", witem);
  c.ptr(bt, "bt", witem);
  c.ptr(packed, "packed", 2);
  py::gil_scoped_release release;
  mask_lora_pack_cpu(as_ptr<const void>(a), as_ptr<const void>(bt), weight_dtype, rank, k, n,
                     as_ptr<std::uint16_t>(packed));
}

}  // namespace

void register_linear(py::module_& m) {
  m.def("linear_packed_size", &packed_size, py::arg("n"), py::arg("k"), py::arg("dtype"),
        "Elements of the packed weight [n, k] that linear takes (panels of 16 output columns).");
  m.def("linear_pack", &pack, py::arg("weight"), py::arg("packed"), py::arg("dtype"), py::arg("n"), py::arg("k"),
        py::arg("ldw"), py::arg("num_threads") = 1,
        R"doc(Pack weight [n, k] (row stride ldw, unit stride along k; dtype 0 fp32, 1 fp16, 2 bf16) into
packed (linear_packed_size(n, k, dtype) elements of that dtype): panels of 16 output columns, k in pairs
for the 16-bit dtypes, zero padded.  Done once per weight; linear and linear_group read it.)doc");
  m.def("linear", &linear, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("dtype"),
        py::arg("m"), py::arg("k"), py::arg("n"), py::arg("ldx"), py::arg("ldo"), py::arg("num_threads") = 1,
        py::arg("isa") = "auto",
        R"doc(out[m, n] = x[m, k] @ W[n, k]^T (+ bias[n]) for few rows (a decode or verification step), W
given packed by linear_pack: float32 accumulation, one rounding to dtype (0 fp32, 1 fp16, 2 bf16); row
strides ldx / ldo in elements, unit stride along k and n; bias 0 for none.  Each output is reduced in an
order independent of m and of the thread count (batch-invariant).  isa: 'auto' (AMX tiles for bf16 where
the CPU has AMX-BF16, else AVX-512, with AVX512_BF16 for bf16, where the CPU has it, else AVX2 + FMA +
F16C, each within $DSPEC_CPU_ISA), 'generic', 'avx2', 'avx512' or 'amx'.  AMX and vdpbf16ps sum a k pair in
different orders (and AVX2 as two FMAs): their bf16 bits differ, so one process keeps one isa for every
row count.  The GIL is released while it runs.)doc");
  m.def("linear_group", &linear_group, py::arg("x"), py::arg("dtype"), py::arg("m"), py::arg("k"), py::arg("weights"),
        py::arg("biases"), py::arg("outs"), py::arg("ns"), py::arg("num_threads") = 1,
        R"doc(linear for several packed weights of one x in one call: outs[p][m, ns[p]] = x[m, k] @ W_p^T
(+ biases[p]; 0 for none), every tensor contiguous.  The parts' columns are split over the threads
together; each output is bit-identical to a linear call on that part alone.)doc");
  m.def("mask_lora", &mask_lora, py::arg("y"), py::arg("x"), py::arg("rows"), py::arg("a"), py::arg("bt"),
        py::arg("scale"), py::arg("dtype"), py::arg("num_rows"), py::arg("total_rows"), py::arg("k"), py::arg("n"),
        py::arg("rank"), py::arg("num_threads") = 1, py::arg("weight_dtype") = 0, py::arg("isa") = "auto",
        py::arg("packed") = 0,
        R"doc(In place y[r] += (scale * (x[r] @ a^T) @ bt).to(dtype) for r in rows (int64 [num_rows], each in
[0, total_rows)): the low-rank update of a mask-selective adapter at the [MASK] rows.  x [total_rows, k]
and y [total_rows, n] contiguous in dtype; a [rank, k] and bt = B^T [rank, n] contiguous in weight_dtype
(0 float32, 2 bfloat16: widened exactly, the math is float32 either way).
float32 sums in a fixed order: a row's bits do not depend on the other rows (nor on num_threads, over
which the rows are split when there are enough).  isa: 'auto' (AVX-512 code for float32 / bfloat16
where the CPU has AVX-512, else the portable loops; the AMX code when packed is given and
mask_lora_has_amx), 'generic' (portable loops: separate multiplies and adds), 'avx512' (fused
multiply-adds; the last bits differ from 'generic') or 'amx' (bfloat16 x / y, rank <= 16, packed: the
adapter as mask_lora_pack lays it out; tile products, h carried as bf16 hi + lo parts, other bits again).
The GIL is released while it runs.)doc");
  m.def("mask_lora_packed_size", &mask_lora_packed_size, py::arg("k"), py::arg("n"),
        "bf16 elements of the packed adapter mask_lora_pack writes for a projection of k inputs, n outputs.");
  m.def("mask_lora_pack", &mask_lora_pack, py::arg("a"), py::arg("bt"), py::arg("packed"), py::arg("rank"),
        py::arg("k"), py::arg("n"), py::arg("weight_dtype"),
        R"doc(Lay out a [rank, k] and bt = B^T [rank, n] (weight_dtype 0 float32, rounded to bf16, or 2
bfloat16; rank <= 16) for mask_lora's AMX code in packed (mask_lora_packed_size(k, n) bf16 elements):
A as a tile operand with k in pairs, then B^T's blocks of 16 outputs with ranks in pairs, zero padded.
Done once per adapter matrix pair.)doc");
  m.def("mask_lora_has_amx", &mask_lora_has_amx, py::arg("dtype"), py::arg("rank"),
        "Whether mask_lora's AMX code runs here for this x / y dtype code and rank (given the packed adapter).");
  m.def(
      "linear_prefetch_steps", [](int steps) { return linear_prefetch_steps(steps); }, py::arg("steps") = -1,
      "The linear tiles' software prefetch distance in k steps: steps >= 0 sets it (returns the old value), "
      "-1 reads it. Results never depend on it.");
  m.def(
      "linear_avx2_chunk_steps",
      [](bool sixteen_bit, int steps) { return linear_avx2_chunk_steps(sixteen_bit, steps); }, py::arg("sixteen_bit"),
      py::arg("steps") = -1,
      "The AVX2 tiles' k chunk in steps, for float32 weights or (sixteen_bit) the bf16 / fp16 "
      "unwidened passes: steps >= 1 sets it (returns the old value), -1 reads it. Results never depend on it.");
  m.def(
      "linear_isa",
      [](int dtype) {
        return std::string(linear_has_amx(dtype)      ? "amx"
                           : linear_has_avx512(dtype) ? "avx512"
                           : linear_has_avx2(dtype)   ? "avx2"
                                                      : "generic");
      },
      py::arg("dtype"), "The code linear runs for this dtype code on this CPU with isa='auto'.");
}

}  // namespace dspec
