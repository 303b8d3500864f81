#include "register.hpp"

namespace resilient::py {

// The detect component's Python bindings are registered here.
void register_detect(pybind11::module_& m) {}

}  // namespace resilient::py
