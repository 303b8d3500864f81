#include "register.hpp"

namespace resilient::py {

// The io component's Python bindings are registered here.
void register_io(pybind11::module_& m) {}

}  // namespace resilient::py
