// Registration of best_first_tree in dspec._C; called from PYBIND11_MODULE in bindings.cpp.
// Defined in best_first_tree_bindings.cpp.
#pragma once

namespace pybind11 {
class module_;
}

namespace dspec {
void register_best_first_tree(pybind11::module_& m);
}
