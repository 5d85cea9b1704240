// Registration of the attention ops (merge_states, cascade_attention) in dspec._C; called from
// PYBIND11_MODULE in bindings.cpp.  Defined in attention_bindings.cpp.
#pragma once

#include <cstdint>
#include <string>

#include "cascade_attention.h"
#include "checks.h"

namespace pybind11 {
class module_;
}

namespace dspec {
void register_attention(pybind11::module_& m);

// Validate cascade_attention's arguments (the binding's, same names) and fill a; false
// when there is nothing to compute (batch or n is 0).  Shared with decoder_layers.
bool cascade_args(const Checker& c, CascadeAttentionArgs& a, std::int64_t q, std::int64_t k, std::int64_t v,
                  std::int64_t out, std::int64_t lse, std::int64_t mask, std::int64_t prefix_k, std::int64_t prefix_v,
                  std::int64_t prefix_indptr, std::int64_t page_table, std::int64_t prefix_lens, int dtype,
                  std::int64_t batch, std::int64_t n, std::int64_t hq, std::int64_t hkv, std::int64_t head_dim,
                  double sm_scale, std::int64_t q_s0, std::int64_t q_s1, std::int64_t q_s2, std::int64_t k_s0,
                  std::int64_t k_s1, std::int64_t k_s2, std::int64_t v_s0, std::int64_t v_s1, std::int64_t v_s2,
                  std::int64_t o_s0, std::int64_t o_s1, std::int64_t o_s2, std::int64_t mask_s0, std::int64_t mask_s1,
                  std::int64_t pk_s0, std::int64_t pk_s1, std::int64_t pk_s2, std::int64_t pv_s0, std::int64_t pv_s1,
                  std::int64_t pv_s2, int indptr_dtype, std::int64_t prefix_rows, std::int64_t page_size,
                  std::int64_t max_pages, std::int64_t page_table_stride, int num_threads, const std::string& isa);
}  // namespace dspec
