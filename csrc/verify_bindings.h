// Registration of verify_chain / verify_tree in dspec._C; called from PYBIND11_MODULE in
// bindings.cpp.  Defined in verify_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_verify(pybind11::module_& m);
}
