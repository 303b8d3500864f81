#include "register.hpp"

namespace resilient::py {

// The comm component's Python bindings are registered here.
void register_comm(pybind11::module_& m) {}

}  // namespace resilient::py
