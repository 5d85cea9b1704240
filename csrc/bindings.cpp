// pybind11 bindings of dspec._C.  No CUDA header here: CUDA work is behind the plain C++
// functions of dspec.h, defined in the .cu files (only when built with DSPEC_WITH_CUDA).
//
// Tensors cross the boundary as integers (tensor.data_ptr()); the module never imports
// torch and touches no GPU at import.  Every argument is validated before any work starts;
// bad arguments raise ValueError (std::invalid_argument) naming the argument.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "checks.h"
#include "cpu_features.h"
#include "dspec.h"
#include "attention_bindings.h"
#include "diffuspec_search_bindings.h"
#include "layer_ops_bindings.h"
#include "decoder_bindings.h"
#include "selfspec_bindings.h"
#include "s2d2_bindings.h"
#include "linear_bindings.h"
#include "topk_bindings.h"
#include "masks_bindings.h"
#include "best_first_tree_bindings.h"
#include "verify_bindings.h"

#ifndef DSPEC_VERSION
#define DSPEC_VERSION "0.0.0"
#endif
#ifndef DSPEC_CUDA_ARCHS
#define DSPEC_CUDA_ARCHS ""
#endif
#ifndef DSPEC_CUDA_VERSION
#define DSPEC_CUDA_VERSION ""
#endif
#ifndef DSPEC_CXX_COMPILER
#define DSPEC_CXX_COMPILER ""
#endif
#ifndef DSPEC_BUILD_TYPE
#define DSPEC_BUILD_TYPE ""
#endif

namespace py = pybind11;

namespace {

using dspec::as_ptr;
using dspec::Checker;

// The workspace of num_splits > 1 fits in int64.
void check_workspace_rows(const Checker& c, std::int64_t rows, std::int64_t num_splits) {
  if (num_splits > 1 && rows > dspec::kI64Max / dspec::kTokenStatsPartialBytes / num_splits) {
    c.fail("rows * num_splits is too large");
  }
}

std::int64_t workspace_bytes(std::int64_t rows, std::int64_t num_splits) {
  const Checker c{"token_stats_workspace_bytes"};
  c.at_least(rows, 0, "rows");
  c.at_least(num_splits, 1, "num_splits");
  check_workspace_rows(c, rows, num_splits);
  return dspec::token_stats_workspace_bytes(rows, num_splits);
}

void token_stats(std::int64_t logits_ptr, int dtype, std::int64_t rows, std::int64_t vocab, std::int64_t row_stride,
                 double inv_temperature, std::int64_t token_ptr, std::int64_t prob_ptr, std::int64_t margin_ptr,
                 std::int64_t entropy_ptr, std::int64_t lse_ptr, const std::string& device, std::int64_t stream,
                 std::int64_t num_splits, std::int64_t workspace_ptr, int num_threads) {
  // ---- validation: nothing is read or written before all of it passes ----
  const Checker c{"token_stats"};
  const bool on_cuda = c.device(device);
  c.float_dtype(dtype, "dtype");
  c.at_least(rows, 0, "rows");
  c.vocab(vocab);
  c.rows_stride(rows, vocab, row_stride, "vocab");
  const float inv_t = static_cast<float>(inv_temperature);
  if (!(std::isfinite(inv_temperature) && inv_temperature > 0.0 && std::isfinite(inv_t) && inv_t > 0.0f)) {
    c.fail("inv_temperature must be a positive finite number (as float32), got " + std::to_string(inv_temperature));
  }
  c.at_least(num_splits, 1, "num_splits");
  if (num_splits > dspec::kI32Max) c.fail("num_splits must be < 2^31, got " + std::to_string(num_splits));
  if (on_cuda && rows > dspec::kI32Max / num_splits) {
    c.fail("rows * num_splits must be < 2^31 (CUDA grid size), got rows=" + std::to_string(rows) +
           " num_splits=" + std::to_string(num_splits));
  }
  check_workspace_rows(c, rows, num_splits);
  if (rows == 0) return;  // empty tensors may report data_ptr() == 0
  c.ptr(logits_ptr, "logits_ptr", dspec::element_size(dtype));
  c.ptr(token_ptr, "token_ptr", 8);
  c.ptr(prob_ptr, "prob_ptr", 4);
  c.ptr(margin_ptr, "margin_ptr", 4);
  c.ptr(entropy_ptr, "entropy_ptr", 4);
  c.ptr(lse_ptr, "lse_ptr", 4);
  if (num_splits > 1) {
    if (workspace_ptr == 0) {
      c.fail(
          "workspace_ptr is a null pointer; num_splits > 1 needs token_stats_workspace_bytes(rows, num_splits) "
          "bytes of workspace");
    }
    c.ptr(workspace_ptr, "workspace_ptr", 4);
  }

  dspec::TokenStatsArgs a;
  a.logits = as_ptr<const void>(logits_ptr);
  a.dtype = dtype;
  a.rows = rows;
  a.vocab = vocab;
  a.row_stride = row_stride;
  a.inv_t = inv_t;
  a.token = as_ptr<std::int64_t>(token_ptr);
  a.prob = as_ptr<float>(prob_ptr);
  a.margin = as_ptr<float>(margin_ptr);
  a.entropy = as_ptr<float>(entropy_ptr);
  a.lse = as_ptr<float>(lse_ptr);
  a.num_splits = num_splits;
  a.workspace = as_ptr<void>(workspace_ptr);
  if (!on_cuda) a.num_threads = dspec::caller_threads(num_threads);
  dspec::run_op(on_cuda, a, stream, dspec::token_stats_cpu, DSPEC_IF_CUDA(dspec::token_stats_cuda));
}

}  // namespace

constexpr const char* kIsaNames[4] = {"generic", "avx2", "avx512", "amx"};

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "dspec compiled kernels (C++ CPU code and, when built with nvcc, CUDA kernels).\n"
      "Tensors are passed as integer addresses (tensor.data_ptr()); importing this module\n"
      "never imports torch nor touches a GPU.";

  m.attr("with_cuda") = py::bool_(dspec::kWithCuda);
  m.attr("cuda_archs") = py::str(DSPEC_CUDA_ARCHS);
  m.attr("__version__") = py::str(DSPEC_VERSION);
  m.attr("token_stats_tile") = py::int_(dspec::kTokenStatsTile);
  m.attr("token_stats_threads") = py::int_(dspec::kTokenStatsThreads);
  m.attr("DTYPE_FLOAT32") = py::int_(static_cast<int>(dspec::kFloat32));
  m.attr("DTYPE_FLOAT16") = py::int_(static_cast<int>(dspec::kFloat16));
  m.attr("DTYPE_BFLOAT16") = py::int_(static_cast<int>(dspec::kBFloat16));

  py::dict info;
  info["version"] = DSPEC_VERSION;
  info["with_cuda"] = dspec::kWithCuda;
  info["cuda_archs"] = DSPEC_CUDA_ARCHS;
  info["cuda_version"] = DSPEC_CUDA_VERSION;
  info["cxx_compiler"] = DSPEC_CXX_COMPILER;
  info["build_type"] = DSPEC_BUILD_TYPE;
  info["cudart"] = dspec::kWithCuda ? "static" : "";
  m.attr("build_info") = info;

  m.def("token_stats", &token_stats, py::arg("logits_ptr"), py::arg("dtype"), py::arg("rows"), py::arg("vocab"),
        py::arg("row_stride"), py::arg("inv_temperature"), py::arg("token_ptr"), py::arg("prob_ptr"),
        py::arg("margin_ptr"), py::arg("entropy_ptr"), py::arg("lse_ptr"), py::arg("device"), py::arg("stream") = 0,
        py::arg("num_splits") = 1, py::arg("workspace_ptr") = 0, py::arg("num_threads") = 0,
        R"doc(Per-row argmax, its probability, top-1 minus top-2 probability, entropy and logsumexp.

logits_ptr: rows x vocab logits, unit stride along vocab, row_stride elements between rows;
dtype: 0 float32, 1 float16, 2 bfloat16.  Outputs (rows each): token int64, prob, margin,
entropy, lse float32.  device "cpu" runs the C++ code (GIL released, std::thread for large
inputs); device "cuda" launches on `stream` (a cudaStream_t as an int) on the current CUDA
device.  num_splits > 1 (CUDA) splits each row's vocabulary over num_splits blocks and needs
workspace_ptr with token_stats_workspace_bytes(rows, num_splits) bytes; the CPU code
validates but otherwise ignores num_splits / workspace_ptr.  num_threads: CPU threads at most
(0: dspec.cpu.kernel_threads()).  rows == 0 is a no-op.
Raises ValueError for a bad argument, RuntimeError when a CUDA launch fails.)doc");

  m.def(
      "cpu_isa", [] { return std::string(kIsaNames[dspec::cpu::isa_level()]); },
      "The instruction-set level dspec's C++ CPU kernels run at: 'generic', 'avx2', 'avx512' or 'amx' "
      "(the CPU's highest, capped by $DSPEC_CPU_ISA or set_cpu_isa_cap).");
  m.def(
      "cpu_isa_of_cpu", [] { return std::string(kIsaNames[dspec::cpu::cpu_level()]); },
      "The highest instruction-set level of this CPU that dspec has code for, the cap aside.");
  m.def(
      "set_cpu_isa_cap",
      [](const std::string& level) {
        for (int i = 0; i < 4; ++i) {
          if (level == kIsaNames[i]) {
            const std::string old = kIsaNames[dspec::cpu::isa_cap()];
            dspec::cpu::set_isa_cap(i);
            return old;
          }
        }
        throw std::invalid_argument("level must be 'generic', 'avx2', 'avx512' or 'amx', got '" + level + "'");
      },
      py::arg("level"),
      "Caps the instruction-set level of every C++ CPU kernel for this process (what $DSPEC_CPU_ISA sets at "
      "load; 'amx' is no cap) and returns the previous cap.  Packed weights stay valid; results may change "
      "bits between levels (AMX and AVX512_BF16 sum bf16 pairs in their own orders).");

  m.def("token_stats_workspace_bytes", &workspace_bytes, py::arg("rows"), py::arg("num_splits"),
        "Bytes of workspace token_stats needs for num_splits > 1 (rows * num_splits * 24), else 0.");

  dspec::register_masks(m);             // csrc/masks_bindings.cpp
  dspec::register_verify(m);            // csrc/verify_bindings.cpp
  dspec::register_attention(m);         // csrc/attention_bindings.cpp
  dspec::register_diffuspec_search(m);  // csrc/diffuspec_search_bindings.cpp
  dspec::register_layer_ops(m);         // csrc/layer_ops_bindings.cpp
  dspec::register_topk(m);              // csrc/topk_bindings.cpp
  dspec::register_linear(m);            // csrc/linear_bindings.cpp
  dspec::register_decoder(m);           // csrc/decoder_bindings.cpp
  dspec::register_selfspec(m);          // csrc/selfspec_bindings.cpp
  dspec::register_s2d2(m);              // csrc/s2d2_bindings.cpp
  dspec::register_best_first_tree(m);   // csrc/best_first_tree_bindings.cpp
}
