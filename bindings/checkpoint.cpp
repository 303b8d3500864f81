#include "register.hpp"

namespace resilient::py {

// The checkpoint component's Python bindings are registered here.
void register_checkpoint(pybind11::module_& m) {}

}  // namespace resilient::py
