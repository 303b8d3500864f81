// resilient._C detect bindings: the native agent (threads, UDP, HMAC), the option structs and
// the simulator. The agent's store is any store as_store() accepts (torch.distributed.TCPStore).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "errors.hpp"
#include "register.hpp"
#include "store.hpp"
#include "resilient/detect/agent.hpp"
#include "resilient/detect/sim.hpp"

namespace resilient::py {
namespace pyb = pybind11;
using namespace resilient::detect;

namespace {

double secs(Duration d) { return to_seconds(d); }

pyb::dict event_dict(const Event& e) {
  pyb::dict d;
  d["kind"] = event_kind_name(e.kind);
  d["time"] = to_seconds(e.at.time_since_epoch());
  d["rank"] = e.rank;
  d["generation"] = e.generation;
  d["detail"] = e.detail;
  pyb::list removed;
  for (const Verdict& v : e.removed) {
    pyb::dict r;
    r["rank"] = v.rank;
    r["reason"] = reason_name(v.reason);
    r["section"] = v.section;
    removed.append(r);
  }
  d["removed"] = removed;
  return d;
}

pyb::dict metrics_dict(const AgentMetrics& m) {
  pyb::dict d;
  const Counters& c = m.core;
  d["messages_sent"] = c.messages_sent;
  d["messages_received"] = c.messages_received;
  d["pings_sent"] = c.pings_sent;
  d["acks_received"] = c.acks_received;
  d["suspicions"] = c.suspicions;
  d["unsuspicions"] = c.unsuspicions;
  d["confirmations"] = c.confirmations;
  d["proposals"] = c.proposals;
  d["generations"] = c.generations;
  d["store_errors"] = c.store_errors;
  d["refusals"] = c.refusals;
  d["dropped_replay"] = c.dropped_replay;
  d["dropped_stale"] = c.dropped_stale;
  d["dropped_misdirected"] = c.dropped_misdirected;
  d["ignored_claims"] = c.ignored_claims;
  d["datagrams_sent"] = m.wire.sent;
  d["datagrams_received"] = m.wire.received;
  d["send_errors"] = m.wire.send_errors;
  d["refused"] = m.wire.refused;
  d["dropped_malformed"] = m.wire.dropped_malformed;
  d["dropped_bad_mac"] = m.wire.dropped_bad_mac;
  d["dropped_other_job"] = m.wire.dropped_other_job;
  d["dropped_other_run"] = m.wire.dropped_other_run;
  d["dropped_version"] = m.wire.dropped_version;
  d["dropped_unknown_source"] = m.wire.dropped_unknown_source;
  d["generation"] = m.generation;
  d["live"] = m.live;
  d["section"] = m.section;
  d["hang_limit_s"] = m.hang_limit_s;
  d["step"] = m.step;
  pyb::list peers;
  for (const PeerStats& p : m.peers) {
    pyb::dict q;
    q["rank"] = p.rank;
    q["phi"] = p.phi;
    q["rtt_ms"] = p.rtt_ms;
    q["mean_interval_ms"] = p.mean_interval_ms;
    q["suspected"] = p.suspected;
    peers.append(q);
  }
  d["peers"] = peers;
  return d;
}

#define DURATION_PROP(cls, field)                              \
  def_property(                                                \
      #field "_s", [](const cls& o) { return secs(o.field); }, \
      [](cls& o, double s) { o.field = from_seconds(s); })

}  // namespace

void register_detect(pyb::module_& root) {
  auto m = root.def_submodule("detect", "failure detector (native core)");

  pyb::class_<CoreOptions>(m, "CoreOptions")
      .def_static(
          "from_env",
          [](int32_t rank, int32_t world_size) {
            return unwrap(CoreOptions::from_env(rank, world_size));
          },
          pyb::arg("rank"), pyb::arg("world_size"))
      .def("validate", [](const CoreOptions& o) { throw_if_error(o.validate()); })
      .def_readwrite("rank", &CoreOptions::rank)
      .def_readwrite("world_size", &CoreOptions::world_size)
      .def_readwrite("watch_count", &CoreOptions::watch_count)
      .def_readwrite("phi_threshold", &CoreOptions::phi_threshold)
      .def_readwrite("gossip_fanout", &CoreOptions::gossip_fanout)
      .def_readwrite("seed", &CoreOptions::seed)
      .DURATION_PROP(CoreOptions, heartbeat_interval)
      .DURATION_PROP(CoreOptions, max_silence)
      .DURATION_PROP(CoreOptions, report_ttl)
      .DURATION_PROP(CoreOptions, refused_silence)
      .DURATION_PROP(CoreOptions, freshness_window)
      .def_property(
          "acceptable_pause_s", [](const CoreOptions& o) { return secs(o.phi.acceptable_pause); },
          [](CoreOptions& o, double s) { o.phi.acceptable_pause = from_seconds(s); })
      .def_property(
          "min_stddev_s", [](const CoreOptions& o) { return secs(o.phi.min_stddev); },
          [](CoreOptions& o, double s) { o.phi.min_stddev = from_seconds(s); });

  pyb::class_<WatchdogOptions>(m, "WatchdogOptions")
      .def_static("from_env", [] { return unwrap(WatchdogOptions::from_env()); })
      .def("validate", [](const WatchdogOptions& o) { throw_if_error(o.validate()); })
      .def_readwrite("safety_factor", &WatchdogOptions::safety_factor)
      .def_readwrite("warmup_steps", &WatchdogOptions::warmup_steps)
      .DURATION_PROP(WatchdogOptions, min_step_limit)
      .DURATION_PROP(WatchdogOptions, step_limit_override)
      .DURATION_PROP(WatchdogOptions, startup_limit)
      .def("set_section_limit", [](WatchdogOptions& o, const std::string& name, double s) {
        o.section_limits[name] = from_seconds(s);
      });

  pyb::class_<AgentOptions>(m, "AgentOptions")
      .def(pyb::init<>())
      .def_readwrite("core", &AgentOptions::core)
      .def_readwrite("watchdog", &AgentOptions::watchdog)
      .def_readwrite("hang_watchdog", &AgentOptions::hang_watchdog)
      .def_readwrite("job", &AgentOptions::job)
      .def_readwrite("run_id", &AgentOptions::run_id)
      .def_property(
          "key", [](const AgentOptions& o) { return pyb::bytes(o.key); },
          [](AgentOptions& o, const std::string& k) { o.key = k; })
      .def_readwrite("addresses", &AgentOptions::addresses)
      .def_readwrite("store_prefix", &AgentOptions::store_prefix)
      .DURATION_PROP(AgentOptions, store_timeout)
      .DURATION_PROP(AgentOptions, poll_interval);

  pyb::class_<Agent>(m, "Agent")
      .def(pyb::init([](AgentOptions opt, pyb::object store) {
             std::shared_ptr<Store> s = as_store(store);
             auto g0 = std::make_shared<const Generation>(Generation::initial(opt.core.world_size));
             return unwrap(Agent::create(std::move(opt), std::move(s), std::move(g0)));
           }),
           pyb::arg("options"), pyb::arg("store"))
      .def_property_readonly("port", &Agent::port)
      .def("set_addresses",
           [](Agent& a, std::vector<std::string> v) {
             throw_if_error(a.set_addresses(std::move(v)));
           })
      .def("start", [](Agent& a) { throw_if_error(a.start()); })
      .def("stop", &Agent::stop, pyb::call_guard<pyb::gil_scoped_release>())
      .def("set_step", &Agent::set_step)
      .def("enter_section", &Agent::enter_section, pyb::call_guard<pyb::gil_scoped_release>())
      .def("leave_section", &Agent::leave_section, pyb::call_guard<pyb::gil_scoped_release>())
      .def(
          "poll_events",
          [](Agent& a, double timeout_s) {
            std::vector<Event> evs;
            {
              pyb::gil_scoped_release nogil;
              evs = a.poll_events(from_seconds(timeout_s));
            }
            pyb::list out;
            for (const Event& e : evs) out.append(event_dict(e));
            return out;
          },
          pyb::arg("timeout_s"))
      .def("metrics",
           [](Agent& a) {
             AgentMetrics m;
             {
               pyb::gil_scoped_release nogil;
               m = a.metrics();
             }
             return metrics_dict(m);
           })
      .def("generation", [](Agent& a) {
        GenerationPtr g;
        {
          pyb::gil_scoped_release nogil;
          g = a.generation();
        }
        return pyb::make_tuple(g->number, g->live);
      });

  m.def("job_id", [](const std::string& name) { return job_id(name); });
  m.def(
      "encode_for_test",
      [](const std::string& key, const std::string& job, int from, uint64_t gen,
         const std::string& run, int to, uint64_t seq, int64_t time_ns) {
        Message msg;
        msg.type = MsgType::kPing;
        msg.from = from;
        msg.to = to;
        msg.generation = gen;
        msg.seq = seq;
        msg.time_ns = time_ns;
        return pyb::bytes(Codec(key, job_id(job), run).encode(msg));
      },
      pyb::arg("key"), pyb::arg("job"), pyb::arg("from_rank"), pyb::arg("generation"),
      pyb::arg("run") = "", pyb::arg("to") = 0, pyb::arg("seq") = 1, pyb::arg("time_ns") = 0,
      "A ping datagram (current wire version), for tests that inject traffic.");
  m.def(
      "monotonic_ns", [] { return SteadyClock::instance().now().time_since_epoch().count(); },
      "The agent's clock (time_ns of datagrams), for tests.");

  m.def("run_simulation", [](const SimOptions& o) {
    SimReport r;
    {
      pyb::gil_scoped_release nogil;
      r = run_simulation(o);
    }
    return r;
  });
  pyb::class_<SimOptions>(m, "SimOptions")
      .def(pyb::init<>())
      .def_readwrite("ranks", &SimOptions::ranks)
      .def_readwrite("duration_s", &SimOptions::duration_s)
      .def_readwrite("warmup_s", &SimOptions::warmup_s)
      .def_readwrite("latency_ms", &SimOptions::latency_ms)
      .def_readwrite("jitter_ms", &SimOptions::jitter_ms)
      .def_readwrite("loss", &SimOptions::loss)
      .def_readwrite("crashes", &SimOptions::crashes)
      .def_readwrite("silent_failures", &SimOptions::silent_failures)
      .def_readwrite("pauses", &SimOptions::pauses)
      .def_readwrite("pause_ms", &SimOptions::pause_ms)
      .def_readwrite("store_latency_ms", &SimOptions::store_latency_ms)
      .def_readwrite("tick_ms", &SimOptions::tick_ms)
      .def_readwrite("phi_window", &SimOptions::phi_window)
      .def_readwrite("seed", &SimOptions::seed)
      .def_readwrite("core", &SimOptions::core);
  pyb::class_<SimReport>(m, "SimReport").def("as_dict", [](const SimReport& r) {
    pyb::dict d;
    d["ranks"] = r.ranks;
    d["sim_seconds"] = r.sim_seconds;
    d["wall_seconds"] = r.wall_seconds;
    d["failures"] = r.failures;
    d["undetected"] = r.undetected;
    d["detect_all_p50_ms"] = r.detect_all_p50_ms;
    d["detect_all_p99_ms"] = r.detect_all_p99_ms;
    d["detect_all_max_ms"] = r.detect_all_max_ms;
    d["crash_p50_ms"] = r.crash_p50_ms;
    d["silent_p50_ms"] = r.silent_p50_ms;
    d["per_rank_p50_ms"] = r.per_rank_p50_ms;
    d["per_rank_p99_ms"] = r.per_rank_p99_ms;
    d["false_positives"] = r.false_positives;
    d["false_suspicions"] = r.false_suspicions;
    d["messages_per_rank_per_s"] = r.messages_per_rank_per_s;
    d["store_ops"] = r.store_ops;
    d["store_ops_per_s"] = r.store_ops_per_s;
    d["store_peak_ops_per_s"] = r.store_peak_ops_per_s;
    d["generations"] = r.generations;
    d["agreed"] = r.agreed;
    return d;
  });
}

}  // namespace resilient::py
