// resilient._C.Store and InMemoryStore, and the adapter that makes a Python store (torch's
// Store API) a native Store. Native waits run without the GIL; calls into Python take it through
// call_python(), which is safe at interpreter shutdown.
#include "store.hpp"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "errors.hpp"
#ifdef RESILIENT_HAVE_ETCD
#include "resilient/common/etcd_store.hpp"
#endif

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

// torch's Store takes str or bytes values.
std::string bytes_arg(const pyb::handle& v) {
  if (pyb::isinstance<pyb::str>(v)) return v.cast<std::string>();
  return pyb::bytes(pyb::reinterpret_borrow<pyb::object>(v)).cast<std::string>();
}

// Without a timeout: torch's default store timeout.
constexpr double kDefaultTimeoutS = 300.0;

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
          [](Store& s, const std::string& key, const pyb::object& value, double timeout_s) {
            std::string v = bytes_arg(value);
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
          pyb::arg("key"), pyb::arg("timeout_s") = kDefaultTimeoutS, pyb::arg("wait") = true,
          "The value; waits up to timeout_s for an absent key (TimeoutError), or with "
          "wait=False raises KeyError at once.")
      .def(
          "compare_set",
          [](Store& s, const std::string& key, const pyb::object& expected,
             const pyb::object& desired, double timeout_s) {
            std::string e = bytes_arg(expected), d = bytes_arg(desired);
            Duration t = seconds_arg(timeout_s);
            Result<std::string> r = [&] {
              pyb::gil_scoped_release nogil;
              return s.compare_set(key, e, d, t);
            }();
            return pyb::bytes(unwrap(std::move(r)));
          },
          pyb::arg("key"), pyb::arg("expected"), pyb::arg("desired"), pyb::arg("timeout_s") = 60.0)
      // torch.distributed.Store's check and wait, so code written for a torch store (the
      // detector's start-up, recovery) takes a native one as it is.
      .def(
          "check",
          [](Store& s, const std::vector<std::string>& keys) {
            Status st;
            {
              pyb::gil_scoped_release nogil;
              for (const auto& key : keys) {
                st = s.get(key, from_seconds(kDefaultTimeoutS), IfAbsent::kFail).status();
                if (!st.ok()) break;
              }
            }
            if (st.code() == StatusCode::kNotFound) return false;
            throw_if_error(st);
            return true;
          },
          pyb::arg("keys"), "Whether every key exists (torch.distributed.Store.check).")
      .def(
          "wait",
          [](Store& s, const std::vector<std::string>& keys, Duration timeout) {
            const TimePoint deadline = SteadyClock().now() + timeout;
            for (const auto& key : keys) {
              Status st;
              {
                pyb::gil_scoped_release nogil;
                Duration left = std::max(Duration::zero(), deadline - SteadyClock().now());
                st = s.get(key, left, IfAbsent::kWait).status();
              }
              throw_if_error(st);
            }
          },
          pyb::arg("keys"), pyb::arg("timeout") = from_seconds(kDefaultTimeoutS),
          "Waits until every key exists (torch.distributed.Store.wait; TimeoutError after "
          "`timeout`, a datetime.timedelta).");

  pyb::class_<InMemoryStore, Store, std::shared_ptr<InMemoryStore>>(
      m, "InMemoryStore", "A process-local Store (tests, single-process use).")
      .def(pyb::init<>())
      .def("set_unavailable", &InMemoryStore::set_unavailable, pyb::arg("unavailable"))
      .def_property_readonly("calls", &InMemoryStore::calls)
      .def("__len__", &InMemoryStore::size);

#ifdef RESILIENT_HAVE_ETCD
  pyb::class_<EtcdStore, Store, std::shared_ptr<EtcdStore>>(
      m, "EtcdStore",
      "The Store on an etcd v3 cluster through its JSON gateway (see docs/store.md); made by "
      "connect_store(\"etcd://...\").")
      .def_property_readonly("endpoints", [](const EtcdStore& s) { return s.options().endpoints; })
      .def_property_readonly("prefix", [](const EtcdStore& s) { return s.options().prefix; })
      .def_property_readonly("requests", &EtcdStore::requests);

  m.def(
      "connect_store",
      [](const std::string& url) -> std::shared_ptr<Store> {
        Result<std::unique_ptr<Store>> r = connect_store(url);
        return std::shared_ptr<Store>(unwrap(std::move(r)));
      },
      pyb::arg("url"),
      "The store a URL names: etcd://[user@]h1:2379,h2:2379/prefix/ (etcds:// with ?ca=, "
      "&cert=, &key= for TLS; the password from RESILIENT_ETCD_PASSWORD) is an EtcdStore, "
      "memory:// an InMemoryStore. ValueError for a malformed URL. No I/O until the first call.");
#endif

  m.def(
      "as_store", [](const pyb::object& obj) { return as_store(obj); }, pyb::arg("store"),
      "The native Store behind `store`: a native one as it is, a torch.distributed.Store (or an "
      "object with its set, get, compare_set, check and wait) through the adapter.");
}

}  // namespace resilient::py
