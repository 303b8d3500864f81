#pragma once
// The one place where C++ Status values become Python exceptions and Python exceptions raised
// into native code (a store, a callback) become Status values (see errors.cpp for both maps).

#include <string>

#include <pybind11/pybind11.h>

#include "resilient/common/status.hpp"

namespace resilient::py {

/// Raises the Python exception for an error Status; does nothing for OK.
void throw_if_error(const Status& status);

/// Returns the value or raises the mapped exception.
template <typename T>
T unwrap(Result<T> result) {
  throw_if_error(result.status());
  return std::move(result).value();
}

/// The Status for a Python exception caught while native code called into Python (GIL held):
/// TimeoutError and torch.distributed.DistStoreError (torch's store timeouts) -> kTimeout,
/// KeyError -> kNotFound, anything else -> kUnavailable. `what` says which call failed.
Status status_from_python(const pybind11::error_already_set& error, const std::string& what);

/// Whether native code may take the GIL: false once the interpreter is finalizing.
bool python_alive();

/// Runs `f` (returning a Status or a Result) with the GIL, from a thread that may or may not hold
/// it: kUnavailable while the interpreter is finalizing, a raised exception mapped through
/// status_from_python(). The one way native code calls into Python.
template <typename F>
auto call_python(const std::string& what, F&& f) -> decltype(f()) {
  if (!python_alive()) return Status(StatusCode::kUnavailable, what + ": interpreter finalizing");
  pybind11::gil_scoped_acquire gil;
  try {
    return f();
  } catch (pybind11::error_already_set& e) {
    return status_from_python(e, what);
  }
}

}  // namespace resilient::py
