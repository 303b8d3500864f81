// resilient._C: calls each component's register function; nothing else lives here.
#include <pybind11/pybind11.h>

#include "register.hpp"

PYBIND11_MODULE(_C, m) {
  m.doc() = "resilient native core";
  resilient::py::register_common(m);
  resilient::py::register_io(m);
  resilient::py::register_checkpoint(m);
  resilient::py::register_codec(m);
  resilient::py::register_detect(m);
  resilient::py::register_comm(m);
  resilient::py::register_straggler(m);
}
