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

}  // namespace

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
      raise(builtins.attr("OSError")(err, msg, path));
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
