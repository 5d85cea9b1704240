// Registration of the masks ops (pack_mask, unpack_mask, tree_mask) in dspec._C; called
// from PYBIND11_MODULE in bindings.cpp.  Defined in masks_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_masks(pybind11::module_& m);
}
