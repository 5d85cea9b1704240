// Argument checks and dispatch shared by the pybind11 bindings (bindings.cpp and the
// *_bindings.cpp files).  Tensors cross the boundary as integer addresses; every argument is
// validated before anything is read or written, and a bad one raises ValueError
// (std::invalid_argument) "dspec._C.<op>: <message naming the argument>".
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dspec.h"

namespace dspec {

#ifdef DSPEC_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

constexpr std::int64_t kI64Max = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kI32Max = std::numeric_limits<std::int32_t>::max();

// Bytes of one element of a float dtype code / an id dtype code.
inline std::int64_t element_size(int dtype) { return dtype == kFloat32 ? 4 : 2; }
inline std::int64_t id_size(int code) { return code == kInt32 ? 4 : 8; }

// A tensor address as a typed pointer.
template <class T>
T* as_ptr(std::int64_t p) {
  return reinterpret_cast<T*>(static_cast<std::intptr_t>(p));
}

// The thread count of a kernel call: num_threads when >= 1 (the Python wrappers pass
// dspec.cpu.kernel_threads()), else (0, the bindings' default) that same count asked of
// dspec.cpu here, with the GIL held: the caller's DSPEC_NUM_THREADS / torch.set_num_threads,
// never the hardware's count.  1 when dspec.cpu cannot be imported.
inline int caller_threads(int num_threads) {
  if (num_threads >= 1) return num_threads;
  try {
    const int n = pybind11::module_::import("dspec.cpu").attr("kernel_threads")().cast<int>();
    return n >= 1 ? n : 1;
  } catch (const pybind11::error_already_set&) {
    return 1;
  } catch (const pybind11::cast_error&) {
    return 1;
  }
}

struct Checker {
  const char* op;  // the op's name in dspec._C, the prefix of every message

  [[noreturn]] void fail(const std::string& msg) const {
    throw std::invalid_argument(std::string("dspec._C.") + op + ": " + msg);
  }
  // A non-null, non-negative address, a multiple of align.
  void ptr(std::int64_t p, const char* name, std::int64_t align) const {
    if (p == 0) fail(std::string(name) + " is a null pointer");
    if (p < 0) fail(std::string(name) + " must be a non-negative address, got " + std::to_string(p));
    if (p % align != 0) {
      fail(std::string(name) + " must be " + std::to_string(align) + "-byte aligned, got " + std::to_string(p));
    }
  }
  // As ptr, but 0 (absent) is fine.
  void optional_ptr(std::int64_t p, const char* name, std::int64_t align) const {
    if (p != 0) ptr(p, name, align);
  }
  // "cpu" or "cuda" (true); "cuda" only in a build with CUDA.
  bool device(const std::string& d) const {
    const bool on_cuda = d == "cuda";
    if (!on_cuda && d != "cpu") fail("device must be 'cpu' or 'cuda', got '" + d + "'");
    if (on_cuda && !kWithCuda) throw std::invalid_argument("dspec._C was built without CUDA");
    return on_cuda;
  }
  // The `isa` argument of the CPU kernels: 0 "auto", 1 "generic", 2 "avx512" (which needs
  // avx512_ok; `needs` says what it needs), for a kernel with AMX tiles (amx_needs not null)
  // 3 "amx" (which needs amx_ok), and for a kernel with AVX2 tiles (avx2_needs not null)
  // 4 "avx2" (which needs avx2_ok).
  int isa(const std::string& name, bool avx512_ok, const char* needs, bool amx_ok = false,
          const char* amx_needs = nullptr, bool avx2_ok = false, const char* avx2_needs = nullptr) const {
    if (name == "auto") return 0;
    if (name == "generic") return 1;
    if (name == "avx512") {
      if (!avx512_ok) fail(std::string("isa 'avx512' needs ") + needs);
      return 2;
    }
    if (amx_needs != nullptr && name == "amx") {
      if (!amx_ok) fail(std::string("isa 'amx' needs ") + amx_needs);
      return 3;
    }
    if (avx2_needs != nullptr && name == "avx2") {
      if (!avx2_ok) fail(std::string("isa 'avx2' needs ") + avx2_needs);
      return 4;
    }
    std::string names = "'auto', 'generic'";
    if (avx2_needs != nullptr) names += ", 'avx2'";
    names += amx_needs != nullptr ? ", 'avx512' or 'amx'" : " or 'avx512'";
    fail("isa must be " + names + ", got '" + name + "'");
  }
  void at_least(std::int64_t v, std::int64_t lo, const char* name) const {
    if (v < lo) fail(std::string(name) + " must be >= " + std::to_string(lo) + ", got " + std::to_string(v));
  }
  void float_dtype(int code, const char* name) const {
    if (code != kFloat32 && code != kFloat16 && code != kBFloat16) {
      fail(std::string(name) + " must be 0 (float32), 1 (float16) or 2 (bfloat16), got " + std::to_string(code));
    }
  }
  void id_dtype(int code, const char* name) const {
    if (code != kInt32 && code != kInt64) {
      fail(std::string(name) + " must be 0 (int32) or 1 (int64), got " + std::to_string(code));
    }
  }
  // Vocabulary size of a logits tensor: ids are int32 inside the kernels.
  void vocab(std::int64_t v) const {
    at_least(v, 1, "vocab");
    if (v > kI32Max) fail("vocab must be < 2^31 (ids are int32 inside the kernels), got " + std::to_string(v));
  }
  // rows x cols elements with row_stride between rows: the stride covers a row, and every
  // offset fits in int64.  cols_name, when given, names cols in the message.
  void rows_stride(std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                   const char* cols_name = nullptr) const {
    // A single row never steps by row_stride (torch reports odd strides for size-1 dims).
    if (row_stride < 0 || (rows > 1 && row_stride < cols)) {
      const std::string bound =
          cols_name ? std::string(cols_name) + " (" + std::to_string(cols) + ")" : std::to_string(cols);
      fail("row_stride must be >= " + bound + ", got " + std::to_string(row_stride));
    }
    if (rows > 1 && (rows - 1) > (kI64Max - cols) / row_stride) fail("rows * row_stride overflows int64");
  }
  // a * b (a, b >= 0) fits in int64; `what` names the product.
  void product(std::int64_t a, std::int64_t b, const char* what) const {
    if (a > 0 && b > kI64Max / a) fail(std::string(what) + " overflows int64");
  }
};

// ---- dispatch ----------------------------------------------------------------------------
// DSPEC_IF_CUDA(f): the CUDA launcher f where the module is built with CUDA, else nullptr
// (the *_cuda functions are only defined in such builds; Checker::device refuses "cuda"
// without them).
#ifdef DSPEC_WITH_CUDA
#define DSPEC_IF_CUDA(f) (f)
#else
#define DSPEC_IF_CUDA(f) nullptr
#endif

// Runs cuda(args, stream) on device "cuda", else cpu(args), with the GIL released.
template <class Args, class CudaFn>
void run_op(bool on_cuda, const Args& args, std::int64_t stream, void (*cpu)(const Args&), CudaFn cuda) {
  pybind11::gil_scoped_release no_gil;
  if constexpr (std::is_null_pointer_v<CudaFn>) {
    (void)on_cuda;
    (void)stream;
    (void)cuda;
    cpu(args);
  } else {
    if (on_cuda) {
      cuda(args, stream);
    } else {
      cpu(args);
    }
  }
}

}  // namespace dspec
