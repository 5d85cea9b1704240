// Registration of the self-speculative engine's round (selfspec_workspace_bytes,
// selfspec_expand, selfspec_score, selfspec_advance) in dspec._C; called from
// PYBIND11_MODULE in bindings.cpp.  Defined in selfspec_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_selfspec(pybind11::module_& m);
}
