// resilient._C.comm: the NCCL loader and the communicator manager, whose store is any store
// as_store() accepts (a torch.distributed.Store, resilient._C.InMemoryStore). Every native wait
// releases the GIL; callbacks into Python (the store, the done query) take it back.
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "errors.hpp"
#include "register.hpp"
#include "store.hpp"
#include "resilient/comm/comm_manager.hpp"

namespace resilient::py {
namespace pyb = pybind11;
using namespace resilient::comm;

namespace {

NcclDataType parse_dtype(const std::string& s) {
  static const std::pair<const char*, NcclDataType> kMap[] = {
      {"int8", NcclDataType::kInt8},       {"uint8", NcclDataType::kUint8},
      {"int32", NcclDataType::kInt32},     {"uint32", NcclDataType::kUint32},
      {"int64", NcclDataType::kInt64},     {"uint64", NcclDataType::kUint64},
      {"float16", NcclDataType::kFloat16}, {"float32", NcclDataType::kFloat32},
      {"float64", NcclDataType::kFloat64}, {"bfloat16", NcclDataType::kBfloat16}};
  for (const auto& [name, v] : kMap) {
    if (s == name) return v;
  }
  throw pyb::value_error("unsupported NCCL dtype '" + s + "'");
}

NcclRedOp parse_op(const std::string& s) {
  if (s == "sum") return NcclRedOp::kSum;
  if (s == "prod") return NcclRedOp::kProd;
  if (s == "max") return NcclRedOp::kMax;
  if (s == "min") return NcclRedOp::kMin;
  if (s == "avg") return NcclRedOp::kAvg;
  throw pyb::value_error("op must be sum, prod, max, min or avg");
}

NcclFeature parse_nccl_feature(const std::string& s) {
  if (s == "non_blocking") return NcclFeature::kNonBlocking;
  if (s == "shrink") return NcclFeature::kShrink;
  if (s == "revoke") return NcclFeature::kRevoke;
  throw pyb::value_error("feature must be non_blocking, shrink or revoke");
}

NcclUniqueId to_id(const pyb::bytes& b) {
  std::string s = b;
  if (s.size() != sizeof(NcclUniqueId::internal)) throw pyb::value_error("unique id: 128 bytes");
  NcclUniqueId id{};
  std::memcpy(id.internal, s.data(), s.size());
  return id;
}

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

/// Runs `f` without the GIL; errors are raised after the GIL is back.
template <typename F>
auto without_gil(F&& f) {
  pyb::gil_scoped_release nogil;
  return f();
}

pyb::dict report_dict(const RecoveryReport& r) {
  pyb::dict d;
  d["teardown"] = teardown_name(r.plan.teardown);
  d["rebuild"] = rebuild_name(r.plan.rebuild);
  d["generation"] = r.generation;
  d["old_rank"] = r.old_rank;
  d["new_rank"] = r.new_rank;
  d["new_size"] = r.new_size;
  d["teardown_s"] = to_seconds(r.teardown);
  d["rebuild_s"] = to_seconds(r.rebuild);
  d["fell_back_to_abort"] = r.fell_back_to_abort;
  return d;
}

void register_options(pyb::module_& s) {
  auto seconds = [](Duration CommOptions::*field) {
    return std::make_pair([field](const CommOptions& o) { return to_seconds(o.*field); },
                          [field](CommOptions& o, double v) {
                            if (!(v >= 0)) throw pyb::value_error("seconds must be >= 0");
                            o.*field = from_seconds(v);
                          });
  };
  pyb::class_<CommOptions> o(s, "CommOptions",
                             "Communicator manager settings (RESILIENT_COMM_* overrides).");
  o.def(pyb::init<>())
      .def_static("from_env", [] { return unwrap(CommOptions::from_env()); })
      .def("validate", [](const CommOptions& c) { throw_if_error(c.validate()); })
      .def_readwrite("name", &CommOptions::name);
  for (auto [name, field] : {std::pair{"init_timeout_s", &CommOptions::init_timeout},
                             std::pair{"collective_timeout_s", &CommOptions::collective_timeout},
                             std::pair{"quiesce_timeout_s", &CommOptions::quiesce_timeout},
                             std::pair{"store_timeout_s", &CommOptions::store_timeout},
                             std::pair{"poll_interval_s", &CommOptions::poll_interval}}) {
    auto [get, set] = seconds(field);
    o.def_property(name, get, set);
  }
  o.def_property(
      "rebuild_mode", [](const CommOptions& c) { return rebuild_mode_name(c.rebuild_mode); },
      [](CommOptions& c, const std::string& v) { c.rebuild_mode = unwrap(parse_rebuild_mode(v)); });
  o.def_property(
      "revoke", [](const CommOptions& c) { return feature_name(c.revoke); },
      [](CommOptions& c, const std::string& v) { c.revoke = unwrap(parse_feature(v)); });
}

}  // namespace

void register_comm(pyb::module_& m) {
  pyb::module_ s = m.def_submodule("comm", "NCCL communicator manager");
  register_options(s);

  pyb::class_<NcclLibrary, std::shared_ptr<NcclLibrary>>(s, "NcclLibrary",
                                                         "NCCL loaded with dlopen.")
      .def_static(
          "load",
          [](const std::string& path, bool search_system, const std::string& enabled) {
            NcclLoadOptions o;
            o.path = path;
            o.search_system = search_system;
            o.enabled = unwrap(parse_feature(enabled));
            throw_if_error(o.validate());
            return std::const_pointer_cast<NcclLibrary>(unwrap(NcclLibrary::load(o)));
          },
          pyb::arg("path") = "", pyb::arg("search_system") = true, pyb::arg("enabled") = "auto")
      .def_property_readonly("version", &NcclLibrary::version)
      .def_property_readonly("version_string",
                             [](const NcclLibrary& l) { return format_nccl_version(l.version()); })
      .def_property_readonly("origin", &NcclLibrary::origin)
      .def("supports", [](const NcclLibrary& l,
                          const std::string& f) { return l.supports(parse_nccl_feature(f)); })
      .def(
          "revoke_comm",
          [](const NcclLibrary& l, std::uintptr_t comm) {
            // Another owner's communicator (torch's ProcessGroupNCCL._comm_ptr()): in-flight
            // operations stop at once, without the teardown an abort does.
            throw_if_error(l.require(NcclFeature::kRevoke));
            if (comm == 0) throw pyb::value_error("revoke_comm: a null communicator");
            auto* c = reinterpret_cast<NcclComm>(comm);
            const int rc = without_gil([&] { return l.api().comm_revoke(c, 0); });
            if (rc != 0) throw std::runtime_error("ncclCommRevoke: " + l.describe(rc, c));
          },
          pyb::arg("comm"),
          "ncclCommRevoke on a communicator given by address, which this library must have made "
          "(load_nccl() finds torch's copy first); errors: NCCL too old, or NCCL's");

  pyb::class_<CommManager>(s, "CommManager", "One non-blocking NCCL communicator.")
      .def(pyb::init([](std::shared_ptr<NcclLibrary> lib, const CommOptions& o) {
             throw_if_error(o.validate());
             return std::make_unique<CommManager>(std::move(lib), o);
           }),
           pyb::arg("library"), pyb::arg("options"))
      .def("new_unique_id",
           [](const CommManager& c) {
             NcclUniqueId id = unwrap(c.new_unique_id());
             return pyb::bytes(id.internal, sizeof(id.internal));
           })
      .def(
          "init",
          [](CommManager& c, const pyb::bytes& id, int nranks, int rank, uint64_t gen) {
            NcclUniqueId uid = to_id(id);
            throw_if_error(without_gil([&] { return c.init(uid, nranks, rank, gen); }));
          },
          pyb::arg("unique_id"), pyb::arg("nranks"), pyb::arg("rank"), pyb::arg("generation") = 0)
      .def(
          "init_from_store",
          [](CommManager& c, const pyb::object& store, uint64_t gen, int nranks, int rank) {
            std::shared_ptr<Store> s = as_store(store);
            throw_if_error(without_gil([&] { return c.init_from_store(*s, gen, nranks, rank); }));
          },
          pyb::arg("store"), pyb::arg("generation"), pyb::arg("nranks"), pyb::arg("rank"))
      .def(
          "all_reduce",
          [](CommManager& c, uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
             const std::string& op, uintptr_t stream) {
            NcclDataType dt = parse_dtype(dtype);
            NcclRedOp rop = parse_op(op);
            throw_if_error(without_gil([&] {
              return c.all_reduce(as_ptr(send), as_ptr(recv), count, dt, rop, as_ptr(stream));
            }));
          },
          pyb::arg("send_ptr"), pyb::arg("recv_ptr"), pyb::arg("count"), pyb::arg("dtype"),
          pyb::arg("op") = "sum", pyb::arg("stream") = 0)
      .def(
          "broadcast",
          [](CommManager& c, uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
             int root, uintptr_t stream) {
            NcclDataType dt = parse_dtype(dtype);
            throw_if_error(without_gil([&] {
              return c.broadcast(as_ptr(send), as_ptr(recv), count, dt, root, as_ptr(stream));
            }));
          },
          pyb::arg("send_ptr"), pyb::arg("recv_ptr"), pyb::arg("count"), pyb::arg("dtype"),
          pyb::arg("root"), pyb::arg("stream") = 0)
      .def(
          "wait",
          [](CommManager& c, pyb::object done, double timeout_s) {
            DoneQuery q;
            if (!done.is_none()) {
              q = [done]() -> Result<bool> {
                pyb::gil_scoped_acquire gil;
                try {
                  return done().cast<bool>();
                } catch (pyb::error_already_set& e) {
                  return Status(StatusCode::kInternal, std::string("done query: ") + e.what());
                }
              };
            }
            throw_if_error(without_gil([&] { return c.wait(q, from_seconds(timeout_s)); }));
          },
          pyb::arg("done"), pyb::arg("timeout_s"),
          "Polls the async error and done() (e.g. torch.cuda.Event.query) until done.")
      .def("check", [](CommManager& c) { throw_if_error(c.check()); })
      .def("abort", [](CommManager& c) { throw_if_error(without_gil([&] { return c.abort(); })); })
      .def("request_abort", &CommManager::request_abort)
      .def(
          "recover",
          [](CommManager& c, uint64_t gen, std::vector<int> excluded, int new_size,
             const pyb::object& store) {
            std::shared_ptr<Store> s = store.is_none() ? nullptr : as_store(store);
            RecoveryReport r = unwrap(without_gil([&] {
              return c.recover({gen, std::move(excluded), new_size}, s.get());
            }));
            return report_dict(r);
          },
          pyb::arg("generation"), pyb::arg("excluded"), pyb::arg("new_size") = 0,
          pyb::arg("store") = pyb::none())
      .def(
          "plan",
          [](const CommManager& c, bool joiners) {
            RecoveryPlan p = unwrap(c.plan(joiners));
            return std::make_pair(teardown_name(p.teardown), rebuild_name(p.rebuild));
          },
          pyb::arg("has_joiners") = false)
      .def_property_readonly("state",
                             [](const CommManager& c) { return comm_state_name(c.state()); })
      .def_property_readonly("rank", &CommManager::rank)
      .def_property_readonly("size", &CommManager::size)
      .def_property_readonly("generation", &CommManager::generation)
      .def_property_readonly(
          "handle", [](const CommManager& c) { return reinterpret_cast<uintptr_t>(c.handle()); });
}

}  // namespace resilient::py
