#include "resilient/detect/sim.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <queue>
#include <random>
#include <set>

namespace resilient::detect {
namespace {

enum class EvKind { kDeliver, kUnreachable, kStoreReply };

struct Ev {
  TimePoint at;
  uint64_t seq;
  EvKind kind;
  int32_t to;
  int32_t peer;
  Message msg;
  GenerationPtr gen;
  bool operator>(const Ev& o) const { return at != o.at ? at > o.at : seq > o.seq; }
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

class Sim {
 public:
  explicit Sim(const SimOptions& o)
      : o_(o), rng_(o.seed), paused_until_(o.ranks), state_(o.ranks, 0) {
    auto g0 = std::make_shared<const Generation>(Generation::initial(o.ranks));
    decided_[0] = g0;
    CoreOptions base = o.core;
    base.world_size = o.ranks;
    base.phi.window = static_cast<size_t>(o.phi_window);
    base.phi.first_interval = base.heartbeat_interval;
    std::uniform_real_distribution<double> phase(0, to_seconds(base.heartbeat_interval));
    for (int r = 0; r < o.ranks; ++r) {
      CoreOptions c = base;
      c.rank = r;
      c.seed = o.seed;
      cores_.push_back(std::make_unique<DetectorCore>(c, g0, t0_ + from_seconds(phase(rng_))));
    }
  }

  SimReport run() {
    auto wall0 = std::chrono::steady_clock::now();
    plan_faults();
    const Duration tick = from_seconds(o_.tick_ms / 1e3);
    const TimePoint end = t0_ + from_seconds(o_.duration_s);
    for (TimePoint now = t0_; now < end; now += tick) {
      apply_faults(now);
      while (!heap_.empty() && heap_.top().at <= now) {
        Ev ev = heap_.top();
        heap_.pop();
        dispatch(std::move(ev));
      }
      for (int r = 0; r < o_.ranks; ++r) {
        if (!runnable(r, now)) continue;
        cores_[r]->tick(now);
        drain(r, now);
      }
    }
    return report(std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count());
  }

 private:
  struct Fault {
    TimePoint at;
    int32_t rank;
    int kind;  // 1 crash, 2 silent, 3 pause
  };

  bool runnable(int r, TimePoint now) const { return state_[r] == 0 && paused_until_[r] <= now; }

  void plan_faults() {
    std::set<int32_t> used;
    std::uniform_int_distribution<int32_t> pick(0, o_.ranks - 1);
    double last = std::max(o_.warmup_s, o_.duration_s - 5.0);
    std::uniform_real_distribution<double> when(o_.warmup_s, last);
    auto add = [&](int n, int kind) {
      for (int i = 0; i < n && static_cast<int>(used.size()) < o_.ranks / 2; ++i) {
        int32_t r;
        do r = pick(rng_);
        while (used.count(r));
        used.insert(r);
        faults_.push_back({t0_ + from_seconds(when(rng_)), r, kind});
      }
    };
    add(o_.crashes, 1);
    add(o_.silent_failures, 2);
    add(o_.pauses, 3);
    std::sort(faults_.begin(), faults_.end(), [](auto& a, auto& b) { return a.at < b.at; });
  }

  void apply_faults(TimePoint now) {
    while (next_fault_ < faults_.size() && faults_[next_fault_].at <= now) {
      const Fault& f = faults_[next_fault_++];
      if (f.kind == 3) {
        paused_until_[f.rank] = now + from_seconds(o_.pause_ms / 1e3);
      } else {
        state_[f.rank] = f.kind;
        failed_at_[f.rank] = now;
        failed_kind_[f.rank] = f.kind;
      }
    }
  }

  Duration delay() {
    double ms = o_.latency_ms +
                std::exponential_distribution<double>(1.0 / std::max(1e-9, o_.jitter_ms))(rng_);
    return from_seconds(ms / 1e3);
  }

  void push(Ev ev) {
    ev.seq = seq_++;
    heap_.push(std::move(ev));
  }

  void drain(int32_t r, TimePoint now) {
    for (auto& o : cores_[r]->take_outbox()) {
      ++messages_;
      if (std::bernoulli_distribution(o_.loss)(rng_)) continue;
      push(Ev{now + delay(), 0, EvKind::kDeliver, o.to, r, std::move(o.msg), nullptr});
    }
    for (auto& req : cores_[r]->take_store_requests()) {
      ++store_ops_;  // the agent reads every generation it learns of from the store
      ++store_ops_by_100ms_[static_cast<int64_t>(to_seconds(now - t0_) * 10)];
      GenerationPtr g;
      auto it = decided_.find(req.number);
      if (req.kind == StoreRequest::Kind::kPropose) {
        if (it == decided_.end()) {
          g = std::make_shared<const Generation>(std::move(req.proposal));
          decided_[req.number] = g;
        } else {
          g = it->second;
        }
      } else if (it != decided_.end()) {
        g = it->second;
      }
      if (g)
        push(Ev{
            now + from_seconds(o_.store_latency_ms / 1e3), 0, EvKind::kStoreReply, r, -1, {}, g});
    }
    for (auto& e : cores_[r]->take_events()) {
      if (e.kind == Event::Kind::kSuspect && !failed_at_.count(e.rank)) ++false_suspicions_;
      if (e.kind != Event::Kind::kGeneration) continue;
      for (const Verdict& v : e.removed) {
        auto f = failed_at_.find(v.rank);
        if (f == failed_at_.end()) {
          falsely_removed_.insert(v.rank);
        } else {
          learned_[v.rank].push_back(to_seconds(now - f->second) * 1e3);
        }
      }
    }
  }

  void dispatch(Ev ev) {
    const int32_t to = ev.to;
    TimePoint now = ev.at;
    if (state_[to] == 1) {  // process gone: pings bounce back as port-unreachable
      if (ev.kind == EvKind::kDeliver && ev.msg.type == MsgType::kPing) {
        push(Ev{now + delay(), 0, EvKind::kUnreachable, ev.peer, to, {}, nullptr});
      }
      return;
    }
    if (state_[to] == 2) return;
    if (paused_until_[to] > now) {  // the kernel buffers it until the process runs again
      ev.at = paused_until_[to];
      push(std::move(ev));
      return;
    }
    switch (ev.kind) {
      case EvKind::kDeliver:
        cores_[to]->on_message(ev.msg, now);
        break;
      case EvKind::kUnreachable:
        cores_[to]->on_unreachable(ev.peer, now);
        break;
      case EvKind::kStoreReply:
        cores_[to]->on_generation(ev.gen, now);
        break;
    }
    drain(to, now);
  }

  SimReport report(double wall) {
    SimReport rep;
    rep.ranks = o_.ranks;
    rep.sim_seconds = o_.duration_s;
    rep.wall_seconds = wall;
    rep.false_positives = static_cast<int>(falsely_removed_.size());
    rep.false_suspicions = false_suspicions_;
    rep.messages_per_rank_per_s = static_cast<double>(messages_) / o_.ranks / o_.duration_s;
    rep.store_ops = store_ops_;
    rep.store_ops_per_s = static_cast<double>(store_ops_) / o_.duration_s;
    for (const auto& [bucket, ops] : store_ops_by_100ms_)
      rep.store_peak_ops_per_s = std::max(rep.store_peak_ops_per_s, 10.0 * ops);
    rep.generations = decided_.rbegin()->first;
    int survivors = 0;
    GenerationPtr final_gen;
    rep.agreed = true;
    for (int r = 0; r < o_.ranks; ++r) {
      if (state_[r] != 0 || cores_[r]->evicted()) continue;
      ++survivors;
      if (!final_gen) final_gen = cores_[r]->generation();
      if (cores_[r]->generation()->number != final_gen->number ||
          cores_[r]->generation()->live != final_gen->live) {
        rep.agreed = false;
      }
    }
    std::vector<double> all, per_rank, crash, silent;
    for (const auto& [rank, at] : failed_at_) {
      ++rep.failures;
      auto& v = learned_[rank];
      per_rank.insert(per_rank.end(), v.begin(), v.end());
      if (static_cast<int>(v.size()) < survivors) {
        ++rep.undetected;
        continue;
      }
      double worst = *std::max_element(v.begin(), v.end());
      all.push_back(worst);
      (failed_kind_[rank] == 1 ? crash : silent).push_back(worst);
    }
    rep.detect_all_p50_ms = percentile(all, 0.5);
    rep.detect_all_p99_ms = percentile(all, 0.99);
    rep.detect_all_max_ms = all.empty() ? 0 : *std::max_element(all.begin(), all.end());
    rep.crash_p50_ms = percentile(crash, 0.5);
    rep.silent_p50_ms = percentile(silent, 0.5);
    rep.per_rank_p50_ms = percentile(per_rank, 0.5);
    rep.per_rank_p99_ms = percentile(per_rank, 0.99);
    return rep;
  }

  SimOptions o_;
  std::mt19937_64 rng_;
  TimePoint t0_{std::chrono::hours(1)};
  std::vector<std::unique_ptr<DetectorCore>> cores_;
  std::vector<TimePoint> paused_until_;
  std::vector<int> state_;  // 0 up, 1 crashed, 2 silent
  std::vector<Fault> faults_;
  size_t next_fault_ = 0;
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> heap_;
  uint64_t seq_ = 0, messages_ = 0, store_ops_ = 0, false_suspicions_ = 0;
  std::map<int64_t, uint64_t> store_ops_by_100ms_;  // simulated time / 100 ms -> store ops
  std::map<uint64_t, GenerationPtr> decided_;
  std::map<int32_t, TimePoint> failed_at_;
  std::map<int32_t, int> failed_kind_;
  std::map<int32_t, std::vector<double>> learned_;
  std::set<int32_t> falsely_removed_;
};

}  // namespace

SimReport run_simulation(const SimOptions& opt) {
  RESILIENT_CHECK(opt.ranks >= 2 && opt.duration_s > 0 && opt.tick_ms > 0, "bad sim options");
  return Sim(opt).run();
}

}  // namespace resilient::detect
