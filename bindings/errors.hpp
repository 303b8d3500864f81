#pragma once
// The one place where C++ Status values become Python exceptions (see errors.cpp for the map).

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

}  // namespace resilient::py
