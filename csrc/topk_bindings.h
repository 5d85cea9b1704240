// Registration of topk_tokens and mass_candidates in dspec._C; called from
// PYBIND11_MODULE in bindings.cpp.  Defined in topk_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_topk(pybind11::module_& m);
}
