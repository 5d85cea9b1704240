// Registration of the small-row linear layer (linear.h) in dspec._C; called from
// PYBIND11_MODULE in bindings.cpp.  Defined in linear_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_linear(pybind11::module_& m);
}
