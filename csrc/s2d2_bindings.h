// Registration of S2D2's compiled step (s2d2_record_layout, s2d2_buffer_sizes, s2d2_plan,
// s2d2_advance, s2d2_open) in dspec._C; called from PYBIND11_MODULE in bindings.cpp.
// Defined in s2d2_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_s2d2(pybind11::module_& m);
}
