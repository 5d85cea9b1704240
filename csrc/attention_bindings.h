// Registration of the attention ops (merge_states) in dspec._C; called from
// PYBIND11_MODULE in bindings.cpp.  Defined in attention_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_attention(pybind11::module_& m);
}
