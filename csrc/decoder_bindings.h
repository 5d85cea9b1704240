// Registration of the decoder-layer stack (decoder_layers, silu_mul) in dspec._C; called
// from PYBIND11_MODULE in bindings.cpp.  Defined in decoder_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_decoder(pybind11::module_& m);
}
