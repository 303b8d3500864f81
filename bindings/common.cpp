#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "errors.hpp"
#include "register.hpp"
#include "store.hpp"
#include "resilient/common/config.hpp"
#include "resilient/common/crash_report.hpp"
#include "resilient/common/logging.hpp"

namespace resilient::py {
namespace pyb = pybind11;

void register_common(pyb::module_& m) {
  register_store(m);
  m.def(
      "parse_bytes", [](const std::string& s) { return unwrap(parse_bytes(s)); },
      "Parses a size such as '16MiB' into bytes.");
  // The settings module (resilient.settings) parses every value through these, so Python and
  // C++ accept and reject the same spellings.
  m.def("parse_int", [](const std::string& s) { return unwrap(parse_int(s)); });
  m.def("parse_float", [](const std::string& s) { return unwrap(parse_double(s)); });
  m.def("parse_bool", [](const std::string& s) { return unwrap(parse_bool(s)); });
  m.def("parse_feature",
        [](const std::string& s) { return std::string(feature_name(unwrap(parse_feature(s)))); });
  m.def("install_crash_handler", &install_crash_handler,
        "On SIGSEGV/SIGBUS/SIGILL/SIGFPE/SIGABRT, writes the signal, the crashing thread's id and "
        "name and its native stack to stderr, then hands the signal on (e.g. to faulthandler).");
  m.def("set_log_level", [](const std::string& level) {
    if (level == "debug")
      set_log_level(LogLevel::kDebug);
    else if (level == "info")
      set_log_level(LogLevel::kInfo);
    else if (level == "warn")
      set_log_level(LogLevel::kWarn);
    else if (level == "error")
      set_log_level(LogLevel::kError);
    else
      throw pyb::value_error("log level must be debug, info, warn or error");
  });
}

}  // namespace resilient::py
