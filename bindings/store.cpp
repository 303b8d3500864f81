// resilient._C.Store and InMemoryStore, and the adapter that makes a Python store (torch's
// Store API) a native Store. Native waits run without the GIL; calls into Python take it through
// call_python(), which is safe at interpreter shutdown.
#include "store.hpp"

#include <string>
#include <utility>

#include "errors.hpp"

namespace resilient::py {
namespace pyb = pybind11;

namespace {

constexpr const char* kStoreMethods[] = {"set", "get", "compare_set", "check", "wait"};

/// A Store over a Python object with torch.distributed.Store's methods. A torch store bounds
/// set/get/check/compare_set by its own timeout (given at its construction); `timeout` bounds
/// the wait of get(kWait).
class PyStore final : public Store {
 public:
  explicit PyStore(pyb::object obj) : obj_(std::move(obj)) {}
  ~PyStore() override {
    if (python_alive()) {
      pyb::gil_scoped_acquire gil;
      obj_ = pyb::object();
    } else {
      obj_.release();  // leak rather than touch a dying interpreter
    }
  }

  Status set(const std::string& key, const std::string& value, Duration) override {
    return call_python("store set " + key, [&]() -> Status {
      obj_.attr("set")(key, pyb::bytes(value));
      return ok_status();
    });
  }

  Result<std::string> get(const std::string& key, Duration timeout, IfAbsent if_absent) override {
    return call_python("store get " + key, [&]() -> Result<std::string> {
      if (if_absent == IfAbsent::kWait) {
        const auto timedelta = pyb::module_::import("datetime").attr("timedelta");
        obj_.attr("wait")(key_list(key), timedelta(pyb::arg("seconds") = to_seconds(timeout)));
      } else if (!exists(key)) {
        return Status(StatusCode::kNotFound, "no store key " + key);
      }
      return obj_.attr("get")(key).cast<std::string>();
    });
  }

  Result<std::string> compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired, Duration) override {
    return call_python("store compare_set " + key, [&]() -> Result<std::string> {
      // torch answers `expected` for an absent key; keys are never deleted, so one that exists
      // now exists when compare_set runs.
      if (!expected.empty() && !exists(key)) {
        return Status(StatusCode::kNotFound, "no store key " + key);
      }
      return obj_.attr("compare_set")(key, pyb::bytes(expected), pyb::bytes(desired))
          .cast<std::string>();
    });
  }

 private:
  static pyb::list key_list(const std::string& key) {
    pyb::list keys;
    keys.append(key);
    return keys;
  }
  bool exists(const std::string& key) { return obj_.attr("check")(key_list(key)).cast<bool>(); }

  pyb::object obj_;
};

Duration seconds_arg(double s) {
  if (!(s >= 0)) throw pyb::value_error("timeout_s must be >= 0");
  return from_seconds(s);
}

}  // namespace

std::shared_ptr<Store> as_store(const pyb::object& obj) {
  if (pyb::isinstance<Store>(obj)) return obj.cast<std::shared_ptr<Store>>();
  for (const char* method : kStoreMethods) {
    if (!pyb::hasattr(obj, method)) {
      throw pyb::type_error(
          "a store needs torch.distributed.Store's set, get, compare_set, "
          "check and wait; " +
          std::string(pyb::str(obj.get_type())) + " has no " + method);
    }
  }
  return std::make_shared<PyStore>(obj);
}

void register_store(pyb::module_& m) {
  pyb::class_<Store, std::shared_ptr<Store>>(
      m, "Store",
      "The job's key/value store (native interface; see cpp/include/resilient/common/store.hpp). "
      "Anything that takes a store also takes a torch.distributed.Store.")
      .def(
          "set",
          [](Store& s, const std::string& key, const pyb::bytes& value, double timeout_s) {
            std::string v = value;
            Duration t = seconds_arg(timeout_s);
            Status st = [&] {
              pyb::gil_scoped_release nogil;
              return s.set(key, v, t);
            }();
            throw_if_error(st);
          },
          pyb::arg("key"), pyb::arg("value"), pyb::arg("timeout_s") = 60.0)
      .def(
          "get",
          [](Store& s, const std::string& key, double timeout_s, bool wait) {
            Duration t = seconds_arg(timeout_s);
            Result<std::string> r = [&] {
              pyb::gil_scoped_release nogil;
              return s.get(key, t, wait ? IfAbsent::kWait : IfAbsent::kFail);
            }();
            return pyb::bytes(unwrap(std::move(r)));
          },
          pyb::arg("key"), pyb::arg("timeout_s"), pyb::arg("wait") = true,
          "The value; waits up to timeout_s for an absent key (TimeoutError), or with "
          "wait=False raises KeyError at once.")
      .def(
          "compare_set",
          [](Store& s, const std::string& key, const pyb::bytes& expected,
             const pyb::bytes& desired, double timeout_s) {
            std::string e = expected, d = desired;
            Duration t = seconds_arg(timeout_s);
            Result<std::string> r = [&] {
              pyb::gil_scoped_release nogil;
              return s.compare_set(key, e, d, t);
            }();
            return pyb::bytes(unwrap(std::move(r)));
          },
          pyb::arg("key"), pyb::arg("expected"), pyb::arg("desired"), pyb::arg("timeout_s") = 60.0);

  pyb::class_<InMemoryStore, Store, std::shared_ptr<InMemoryStore>>(
      m, "InMemoryStore", "A process-local Store (tests, single-process use).")
      .def(pyb::init<>())
      .def("set_unavailable", &InMemoryStore::set_unavailable, pyb::arg("unavailable"))
      .def_property_readonly("calls", &InMemoryStore::calls)
      .def("__len__", &InMemoryStore::size);

  m.def(
      "as_store", [](const pyb::object& obj) { return as_store(obj); }, pyb::arg("store"),
      "The native Store behind `store`: a native one as it is, a torch.distributed.Store (or an "
      "object with its set, get, compare_set, check and wait) through the adapter.");
}

}  // namespace resilient::py
