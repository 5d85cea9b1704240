// Registration of diffuspec_search (DiffuSpec's causal-consistency path search) in dspec._C;
// called from PYBIND11_MODULE in bindings.cpp.  Defined in diffuspec_search_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_diffuspec_search(pybind11::module_& m);
}
