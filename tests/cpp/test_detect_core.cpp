// Deterministic tests of the detector state machine: a simulated cluster of DetectorCores on a
// ManualClock, a lossless 1 ms network and an in-memory store. No sleeps, no sockets.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "resilient/detect/core.hpp"

namespace resilient::detect {
namespace {
using std::chrono::milliseconds;

class Cluster {
 public:
  explicit Cluster(int n, CoreOptions base = {}) {
    auto g0 = std::make_shared<const Generation>(Generation::initial(n));
    for (int r = 0; r < n; ++r) {
      CoreOptions o = base;
      o.rank = r;
      o.world_size = n;
      cores_.push_back(std::make_unique<DetectorCore>(o, g0, clock_.now()));
    }
  }

  /// Process gone: its port refuses pings (kill -9).
  void crash(int r) { crashed_.insert(r); }
  /// Alive but silent (SIGSTOP, frozen host): no replies, no refusals.
  void stop(int r) { stopped_.insert(r); }
  /// Drops everything to and from r.
  void isolate(int r) { isolated_.insert(r); }
  bool down(int r) const { return crashed_.count(r) || stopped_.count(r); }

  void step(Duration dt = milliseconds(10)) {
    TimePoint end = clock_.now() + dt;
    while (!queue_.empty() && queue_.begin()->first <= end) {
      auto [at, fn] = *queue_.begin();
      queue_.erase(queue_.begin());
      clock_.set(at);
      fn();
    }
    clock_.set(end);
    for (int r = 0; r < size(); ++r) {
      if (!down(r)) {
        cores_[r]->tick(clock_.now());
        drain(r);
      }
    }
  }

  /// Steps until `pred` holds or `limit` passes; returns the elapsed time or -1.
  template <typename Pred>
  double run_until(Pred pred, Duration limit) {
    TimePoint start = clock_.now();
    while (clock_.now() - start < limit) {
      step();
      if (pred()) return to_seconds(clock_.now() - start);
    }
    return -1;
  }

  /// True when every up rank is at generation `g` and `gone` is not in it.
  bool all_agree(uint64_t g, const std::set<int>& gone) {
    for (int r = 0; r < size(); ++r) {
      if (down(r) || gone.count(r)) continue;
      const auto& gen = cores_[r]->generation();
      if (gen->number != g) return false;
      for (int x : gone) if (gen->contains(x)) return false;
    }
    return true;
  }

  int size() const { return static_cast<int>(cores_.size()); }
  DetectorCore& core(int r) { return *cores_[r]; }
  ManualClock& clock() { return clock_; }
  InMemoryStore& store() { return store_; }
  std::vector<Event>& events(int r) { return events_[r]; }

 private:
  void later(Duration d, std::function<void()> fn) {
    queue_.emplace(clock_.now() + d, std::move(fn));
  }
  void drain(int r) {
    for (auto& o : cores_[r]->take_outbox()) {
      if (isolated_.count(r) || isolated_.count(o.to)) continue;
      int to = o.to;
      if (crashed_.count(to)) {
        if (o.msg.type == MsgType::kPing) {
          later(milliseconds(1), [this, r, to] { cores_[r]->on_unreachable(to, clock_.now()); drain(r); });
        }
        continue;
      }
      later(milliseconds(1), [this, to, m = o.msg] {
        if (down(to)) return;
        cores_[to]->on_message(m, clock_.now());
        drain(to);
      });
    }
    for (auto& req : cores_[r]->take_store_requests()) {
      if (isolated_.count(r)) continue;  // cannot reach the store either
      later(milliseconds(2), [this, r, req] {
        if (down(r)) return;
        Result<Generation> g = req.kind == StoreRequest::Kind::kPropose
            ? decide_generation(store_, "t", req.proposal, milliseconds(100))
            : read_generation(store_, "t", req.number, milliseconds(100));
        if (g.ok()) cores_[r]->on_generation(std::make_shared<const Generation>(*g), clock_.now());
        else cores_[r]->on_store_error(req, clock_.now());
        drain(r);
      });
    }
    for (auto& e : cores_[r]->take_events()) events_[r].push_back(std::move(e));
  }

  ManualClock clock_{TimePoint{} + std::chrono::hours(1)};
  InMemoryStore store_;
  std::vector<std::unique_ptr<DetectorCore>> cores_;
  std::multimap<TimePoint, std::function<void()>> queue_;
  std::set<int> crashed_, stopped_, isolated_;
  std::map<int, std::vector<Event>> events_;
};

TEST(DetectCore, HealthyClusterNeverSuspects) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(60));
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(c.core(r).generation()->number, 0u);
    EXPECT_EQ(c.core(r).counters().suspicions, 0u) << r;
    EXPECT_EQ(c.core(r).watched().size(), 3u);
  }
}

TEST(DetectCore, CrashedRankRemovedFastByRefusal) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  c.crash(3);
  double t = c.run_until([&] { return c.all_agree(1, {3}); }, std::chrono::seconds(2));
  ASSERT_GE(t, 0);
  EXPECT_LE(t, 0.5);  // one ping interval + store round trip + gossip
  auto g = c.core(0).generation();
  ASSERT_EQ(g->removed.size(), 1u);
  EXPECT_EQ(g->removed[0].rank, 3);
  EXPECT_EQ(g->removed[0].reason, Reason::kCrash);
  EXPECT_EQ(g->live.size(), 7u);
}

TEST(DetectCore, SilentRankConfirmedByTwoWatchersWithinThreeSeconds) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(5));
  c.stop(5);
  double t = c.run_until([&] { return c.all_agree(1, {5}); }, std::chrono::seconds(5));
  ASSERT_GE(t, 0);
  EXPECT_GE(t, 1.0);  // adaptive threshold, not a single late packet
  EXPECT_LE(t, 3.0);
  EXPECT_EQ(c.core(0).generation()->removed[0].reason, Reason::kUnresponsive);
}

TEST(DetectCore, RankZeroAndTwoAtOnce) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  c.crash(0);
  c.crash(1);
  double t = c.run_until([&] {
    for (int r = 2; r < 8; ++r) {
      if (c.core(r).generation()->live != std::vector<int32_t>{2, 3, 4, 5, 6, 7}) return false;
    }
    return true;
  }, std::chrono::seconds(3));
  ASSERT_GE(t, 0);
  EXPECT_LE(t, 0.5);
}

TEST(DetectCore, IsolatedRankIsRemovedNotItsPeers) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  c.isolate(2);
  double t = c.run_until([&] { return c.all_agree(1, {2}); }, std::chrono::seconds(5));
  ASSERT_GE(t, 0);
  c.run_until([] { return false; }, std::chrono::seconds(5));
  for (int r = 0; r < 8; ++r) {
    if (r != 2) EXPECT_EQ(c.core(r).generation()->live.size(), 7u) << r;
  }
  // The isolated rank suspected its peers but could not confirm them alone.
  EXPECT_GT(c.core(2).counters().suspicions, 0u);
  EXPECT_EQ(c.core(2).generation()->number, 0u);
}

TEST(DetectCore, StoreOutageDelaysButDoesNotLoseTheVerdict) {
  Cluster c(6);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  c.store().set_unavailable(true);
  c.crash(4);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  EXPECT_EQ(c.core(0).generation()->number, 0u);
  EXPECT_GT(c.core(3).counters().store_errors, 0u);
  c.store().set_unavailable(false);
  EXPECT_GE(c.run_until([&] { return c.all_agree(1, {4}); }, std::chrono::seconds(3)), 0);
}

TEST(DetectCore, HangSelfReportReachesEveryRank) {
  Cluster c(5);
  c.run_until([] { return false; }, std::chrono::seconds(1));
  c.core(2).report_self(Verdict{2, Reason::kHang, "checkpoint"}, c.clock().now());
  ASSERT_GE(c.run_until([&] { return c.all_agree(1, {2}); }, std::chrono::seconds(1)), 0);
  for (int r : {0, 1, 3, 4}) {
    const Event* gen = nullptr;
    for (const Event& e : c.events(r)) if (e.kind == Event::Kind::kGeneration) gen = &e;
    ASSERT_NE(gen, nullptr);
    ASSERT_EQ(gen->removed.size(), 1u);
    EXPECT_EQ(gen->removed[0].reason, Reason::kHang);
    EXPECT_EQ(gen->removed[0].section, "checkpoint");
  }
  EXPECT_TRUE(c.core(2).evicted());
}

TEST(DetectCore, SequentialFailuresGetSuccessiveGenerations) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  c.crash(6);
  ASSERT_GE(c.run_until([&] { return c.all_agree(1, {6}); }, std::chrono::seconds(2)), 0);
  c.stop(1);
  ASSERT_GE(c.run_until([&] { return c.all_agree(2, {6, 1}); }, std::chrono::seconds(5)), 0);
  // Watch sets follow the live ring: rank 0 now watches 2, 3, 4.
  EXPECT_EQ(c.core(0).watched(), (std::vector<int32_t>{2, 3, 4}));
}

TEST(DetectCore, ForeignSuspicionAloneDoesNotConfirm) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  Message m;
  m.type = MsgType::kSuspect;
  m.from = 1;
  m.verdicts = {Verdict{3, Reason::kUnresponsive, ""}};
  for (int i = 0; i < 10; ++i) c.core(2).on_message(m, c.clock().now());
  c.run_until([] { return false; }, std::chrono::seconds(3));
  EXPECT_EQ(c.core(2).counters().confirmations, 0u);
  EXPECT_EQ(c.core(0).generation()->number, 0u);
}

}  // namespace
}  // namespace resilient::detect
