// Registration of the fused layer ops (rms_norm, rope) in dspec._C; called from
// PYBIND11_MODULE in bindings.cpp.  Defined in layer_ops_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_layer_ops(pybind11::module_& m);
}
