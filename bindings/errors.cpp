// Status -> Python exception map:
//   Corrupt          -> resilient.CorruptCheckpointError (path, offset attributes)
//   VersionMismatch  -> resilient.VersionMismatchError
//   IoError          -> OSError(errno, message, path)
//   NoSpace          -> OSError(ENOSPC, ...)
//   NotFound         -> FileNotFoundError (a path is known) or KeyError
//   Timeout          -> TimeoutError
//   InvalidArgument  -> ValueError
//   Unavailable      -> resilient.UnavailableError
//   Cancelled        -> resilient.CancelledError
//   ResourceExhausted-> resilient.ResourceExhaustedError
//   others           -> resilient.ResilientError
// Python exception -> Status map (an exception raised into native code by a store):
//   TimeoutError, torch.distributed.DistStoreError -> Timeout
//   KeyError                                       -> NotFound
//   others                                         -> Unavailable
#include "errors.hpp"

#include <cerrno>

namespace resilient::py {
namespace pyb = pybind11;

namespace {

pyb::object error_class(const char* name) {
  return pyb::module_::import("resilient.errors").attr(name);
}

[[noreturn]] void raise(pyb::object exc) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw pyb::error_already_set();
}

/// torch.distributed.DistStoreError when torch is already imported (never imports it).
bool is_torch_store_error(const pyb::error_already_set& error) {
  pyb::dict modules = pyb::module_::import("sys").attr("modules");
  if (!modules.contains("torch.distributed")) return false;
  pyb::object dist = modules["torch.distributed"];
  return pyb::hasattr(dist, "DistStoreError") && error.matches(dist.attr("DistStoreError"));
}

/// An I/O error's text for OSError(errno, text, path): the message without the path, which
/// OSError prints once itself, and where in the file it happened.
std::string os_message(const Status& s) {
  std::string msg = s.message();
  const std::string in_path = " (" + s.path() + ")";
  if (!s.path().empty() && msg.size() >= in_path.size() &&
      msg.compare(msg.size() - in_path.size(), in_path.size(), in_path) == 0) {
    msg.resize(msg.size() - in_path.size());
  }
  if (s.offset()) msg += " at offset " + std::to_string(*s.offset());
  return msg;
}

}  // namespace

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

Status status_from_python(const pyb::error_already_set& error, const std::string& what) {
  StatusCode code = StatusCode::kUnavailable;
  if (error.matches(PyExc_TimeoutError) || is_torch_store_error(error)) {
    code = StatusCode::kTimeout;
  } else if (error.matches(PyExc_KeyError)) {
    code = StatusCode::kNotFound;
  }
  return Status(code, what + ": " + error.what());
}

void throw_if_error(const Status& s) {
  if (s.ok()) return;
  pyb::gil_scoped_acquire gil;
  const std::string msg = s.to_string();
  pyb::object path = s.path().empty() ? pyb::none() : pyb::object(pyb::str(s.path()));
  pyb::object offset = s.offset() ? pyb::object(pyb::int_(*s.offset())) : pyb::none();
  pyb::object builtins = pyb::module_::import("builtins");
  switch (s.code()) {
    case StatusCode::kCorrupt:
      raise(error_class("CorruptCheckpointError")(msg, path, offset));
    case StatusCode::kVersionMismatch:
      raise(error_class("VersionMismatchError")(msg, path));
    case StatusCode::kIoError:
    case StatusCode::kNoSpace: {
      int err = s.sys_errno() ? s.sys_errno() : (s.code() == StatusCode::kNoSpace ? ENOSPC : EIO);
      raise(builtins.attr("OSError")(err, os_message(s), path));
    }
    case StatusCode::kNotFound:
      if (!s.path().empty()) raise(builtins.attr("FileNotFoundError")(ENOENT, msg, path));
      raise(builtins.attr("KeyError")(msg));
    case StatusCode::kTimeout:
      raise(builtins.attr("TimeoutError")(msg));
    case StatusCode::kInvalidArgument:
      raise(builtins.attr("ValueError")(msg));
    case StatusCode::kUnavailable:
      raise(error_class("UnavailableError")(msg));
    case StatusCode::kCancelled:
      raise(error_class("CancelledError")(msg));
    case StatusCode::kResourceExhausted:
      raise(error_class("ResourceExhaustedError")(msg));
    default:
      raise(error_class("ResilientError")(msg));
  }
}

}  // namespace resilient::py
