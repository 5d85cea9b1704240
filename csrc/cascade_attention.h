// cascade_attention on the CPU: N suffix queries per request attend to the request's whole
// prefix (ragged rows or pages of a KV cache) and to the suffix keys their packed mask
// row allows (see DESIGN.md "Masks and attention" and dspec/reference/attention.py).
//
// Every tensor crosses as an address plus element strides (the last dim, D, has unit
// stride), so views of a KV cache are read in place.  All offsets are int64.  The bindings
// (attention_bindings.cpp) validate every argument, including the prefix metadata values
// (indptr / lengths / page ids), before cascade_attention_cpu runs.
#pragma once

#include <cstdint>

#include "dspec.h"

namespace dspec {

enum CascadePrefix : int { kPrefixNone = 0, kPrefixRagged = 1, kPrefixPaged = 2 };
// Which vector code runs the tiles: the best the CPU has, the portable C++ loops (compiled
// for AVX2+FMA and baseline x86-64), AVX2 + FMA tiles or AVX-512 (each refused by the
// bindings when missing).  auto: AMX tiles for bf16 (head_dim a multiple of 32) where the
// process may use them, else AVX-512 where the CPU has it, else AVX2; all within
// $DSPEC_CPU_ISA (cpu_features.h).
enum CascadeIsa : int { kIsaAuto = 0, kIsaGeneric = 1, kIsaAvx512 = 2, kIsaAmx = 3, kIsaAvx2 = 4 };

struct CascadeAttentionArgs {
  int dtype = kFloat32;       // q, k, v, out, prefix_k, prefix_v
  std::int64_t batch = 0;     // B
  std::int64_t n = 0;         // N suffix tokens per request
  std::int64_t hq = 0;        // query heads
  std::int64_t hkv = 0;       // KV heads (hq % hkv == 0; query head h uses h / (hq / hkv))
  std::int64_t head_dim = 0;  // D
  float sm_scale = 1.0f;

  // [B, N, H, D] tensors: element strides of (batch, token, head)
  const void* q = nullptr;
  std::int64_t q_stride[3] = {0, 0, 0};
  const void* k = nullptr;
  std::int64_t k_stride[3] = {0, 0, 0};
  const void* v = nullptr;
  std::int64_t v_stride[3] = {0, 0, 0};
  void* out = nullptr;
  std::int64_t out_stride[3] = {0, 0, 0};
  float* lse = nullptr;  // [B, N, Hq] contiguous, natural log; nullptr: not wanted

  // packed int32 words, row i bit j = suffix query i sees suffix key j; strides (batch,
  // row) in words, batch stride 0 for one mask shared by the batch; nullptr: all visible
  const std::int32_t* mask = nullptr;
  std::int64_t mask_stride[2] = {0, 0};

  // prefix: ragged rows [T, Hkv, D] (page stride unused) with indptr [B + 1], or pages
  // [num_pages, page_size, Hkv, D] with page_table [B, max_pages] and lens [B]
  int prefix = kPrefixNone;
  const void* prefix_k = nullptr;
  std::int64_t prefix_k_stride[3] = {0, 0, 0};  // page, row, head
  const void* prefix_v = nullptr;
  std::int64_t prefix_v_stride[3] = {0, 0, 0};
  const void* prefix_indptr = nullptr;
  int indptr_dtype = kInt32;
  const std::int32_t* page_table = nullptr;
  std::int64_t page_table_stride = 0;  // entries between requests
  const std::int32_t* prefix_lens = nullptr;
  std::int64_t page_size = 1;

  int num_threads = 1;  // upper bound; small calls run on the calling thread
  int isa = kIsaAuto;
};

// Assumes validated arguments (attention_bindings.cpp); B == 0 or N == 0 is a no-op.
void cascade_attention_cpu(const CascadeAttentionArgs& args);
// Whether this CPU runs the AVX-512 tile code.
bool cascade_attention_has_avx512();
// Whether the AMX-BF16 tiles run for this dtype and head_dim in this process.
bool cascade_attention_has_amx(int dtype, std::int64_t head_dim);

}  // namespace dspec
