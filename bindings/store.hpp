#pragma once
// The one adapter between Python stores and the native Store (common/store.hpp), used by every
// binding that takes a store (the detector's agent, the communicator manager).

#include <memory>

#include <pybind11/pybind11.h>

#include "resilient/common/store.hpp"

namespace resilient::py {

/// The native Store behind `obj`: a native Store (resilient._C.InMemoryStore) as it is, any other
/// object through an adapter that calls the torch.distributed.Store methods set, get,
/// compare_set, check and wait (TCPStore, PrefixStore, HashStore, or a Python class with those
/// methods). The adapter takes the GIL for each call, refusing (kUnavailable) once the interpreter
/// is finalizing, and maps a raised exception to a Status through status_from_python().
/// Raises TypeError when `obj` lacks one of those methods. Call with the GIL held.
std::shared_ptr<Store> as_store(const pybind11::object& obj);

/// Registers resilient._C.Store (the native interface, with set/get/compare_set callable from
/// Python) and resilient._C.InMemoryStore.
void register_store(pybind11::module_& m);

}  // namespace resilient::py
