#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "errors.hpp"
#include "register.hpp"
#include "store.hpp"
#include "resilient/common/config.hpp"
#include "resilient/common/crash_report.hpp"
#include "resilient/common/logging.hpp"
#include "resilient/memory/populate.hpp"

namespace resilient::py {
namespace pyb = pybind11;

namespace {

std::atomic_ref<int64_t> word_at(uintptr_t addr) {
  if (addr % alignof(int64_t) != 0) throw pyb::value_error("an int64 word must be 8-byte aligned");
  return std::atomic_ref<int64_t>(*reinterpret_cast<int64_t*>(addr));
}

// Memory that several processes map (the shared restore's /dev/shm buffer): progress words
// published with release and read with acquire, so that the bytes a reader put in place before
// publishing are visible to the process that sees the word (plain stores would do on x86, not
// on Arm); and pages reserved before they are written.
void register_shared_memory(pyb::module_& m) {
  m.def(
      "publish_i64",
      [](uintptr_t addr, int64_t value) { word_at(addr).store(value, std::memory_order_release); },
      pyb::arg("addr"), pyb::arg("value"), "Stores `value` at `addr` (release).");
  m.def(
      "observe_i64", [](uintptr_t addr) { return word_at(addr).load(std::memory_order_acquire); },
      pyb::arg("addr"), "The int64 at `addr` (acquire).");
  m.def(
      "observe_many",
      [](uintptr_t addr, size_t count) {
        std::string out(count, '\0');
        for (size_t i = 0; i < count; ++i)
          out[i] = static_cast<char>(word_at(addr + 8 * i).load(std::memory_order_acquire) & 1);
        return pyb::bytes(out);
      },
      pyb::arg("addr"), pyb::arg("count"),
      "Whether each of the `count` int64 words from `addr` is odd (acquire; a read target's done "
      "word once the tensor is in place): one byte, 0 or 1, per word.");
  m.def(
      "populate_write",
      [](uintptr_t addr, uint64_t nbytes) {
        return memory::populate_write(reinterpret_cast<void*>(addr), nbytes);
      },
      pyb::arg("addr"), pyb::arg("nbytes"), pyb::call_guard<pyb::gil_scoped_release>(),
      "Allocates the pages of a shared mapping that cover [addr, addr + nbytes) "
      "(madvise MADV_POPULATE_WRITE). Returns 0, or the errno: EFAULT where a page could not be "
      "had (a full tmpfs; no SIGBUS), EINVAL on kernels before 5.14.");
}

}  // namespace

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
  register_shared_memory(m);
}

}  // namespace resilient::py
