#pragma once
#include <pybind11/pybind11.h>

namespace resilient::py {
void register_common(pybind11::module_& m);
void register_io(pybind11::module_& m);
void register_checkpoint(pybind11::module_& m);
void register_codec(pybind11::module_& m);
void register_detect(pybind11::module_& m);
void register_comm(pybind11::module_& m);
void register_straggler(pybind11::module_& m);
}  // namespace resilient::py
