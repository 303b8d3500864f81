#include "register.hpp"

namespace resilient::py {

// The straggler component's Python bindings are registered here.
void register_straggler(pybind11::module_& m) {}

}  // namespace resilient::py
