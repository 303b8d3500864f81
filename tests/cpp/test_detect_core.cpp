// Deterministic tests of the detector state machine: a simulated cluster of DetectorCores on a
// ManualClock, a lossless 1 ms network and an in-memory store. No sleeps, no sockets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "resilient/detect/core.hpp"

namespace resilient::detect {
namespace {
using std::chrono::milliseconds;
using std::chrono::seconds;

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
  /// SIGCONT: a stopped rank runs again (its next tick comes after the whole gap).
  void resume(int r) { stopped_.erase(r); }
  /// Drops everything to and from r.
  void isolate(int r) { isolated_.insert(r); }
  /// Drops every datagram to and from r; its store calls still go through (a partition
  /// between the ranks, not from the store).
  void cut(int r) { cut_.insert(r); }
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
      for (int x : gone)
        if (gen->contains(x)) return false;
    }
    return true;
  }

  int size() const { return static_cast<int>(cores_.size()); }
  DetectorCore& core(int r) { return *cores_[r]; }
  ManualClock& clock() { return clock_; }
  InMemoryStore& store() { return store_; }
  std::vector<Event>& events(int r) { return events_[r]; }
  /// Every message rank r sent so far (what an eavesdropper could record).
  const std::vector<Message>& sent(int r) { return sent_[r]; }
  /// Delivers `m` to rank `to` as if it came off the network (a replay, a forgery).
  void inject(int to, const Message& m) {
    cores_[to]->on_message(m, clock_.now());
    drain(to);
  }

 private:
  void later(Duration d, std::function<void()> fn) {
    queue_.emplace(clock_.now() + d, std::move(fn));
  }
  void drain(int r) {
    for (auto& o : cores_[r]->take_outbox()) {
      sent_[r].push_back(o.msg);
      if (isolated_.count(r) || isolated_.count(o.to) || cut_.count(r) || cut_.count(o.to)) {
        continue;
      }
      int to = o.to;
      if (crashed_.count(to)) {
        if (o.msg.type == MsgType::kPing) {
          later(milliseconds(1), [this, r, to] {
            cores_[r]->on_unreachable(to, clock_.now());
            drain(r);
          });
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
        if (g.ok())
          cores_[r]->on_generation(std::make_shared<const Generation>(*g), clock_.now());
        else
          cores_[r]->on_store_error(req, clock_.now());
        drain(r);
      });
    }
    for (auto& e : cores_[r]->take_events()) events_[r].push_back(std::move(e));
  }

  ManualClock clock_{TimePoint{} + std::chrono::hours(1)};
  InMemoryStore store_;
  std::vector<std::unique_ptr<DetectorCore>> cores_;
  std::multimap<TimePoint, std::function<void()>> queue_;
  std::set<int> crashed_, stopped_, isolated_, cut_;
  std::map<int, std::vector<Event>> events_;
  std::map<int, std::vector<Message>> sent_;
};

/// A well-formed message as rank `from`'s core would send it at `now` (number `seq`).
Message message(MsgType type, int32_t from, int32_t to, uint64_t seq, TimePoint now) {
  Message m;
  m.type = type;
  m.from = from;
  m.to = to;
  m.seq = seq;
  m.time_ns = now.time_since_epoch().count();
  return m;
}

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
  double t = c.run_until(
      [&] {
        for (int r = 2; r < 8; ++r) {
          if (c.core(r).generation()->live != std::vector<int32_t>{2, 3, 4, 5, 6, 7}) return false;
        }
        return true;
      },
      std::chrono::seconds(3));
  ASSERT_GE(t, 0);
  EXPECT_LE(t, 0.5);
}

// Ranks lost together: with 3 ranks, each dead rank's other watcher is the other dead rank, so
// no suspicion is ever seconded. The survivor confirms both alone once neither has been heard
// from for max_silence beyond its suspicion.
TEST(DetectCore, TwoOfThreeLostAtOnceAreRemoved) {
  for (bool frozen : {false, true}) {
    Cluster c(3);
    c.run_until([] { return false; }, std::chrono::seconds(2));
    for (int r : {1, 2}) frozen ? c.stop(r) : c.crash(r);
    double t = c.run_until([&] { return c.core(0).generation()->live == std::vector<int32_t>{0}; },
                           std::chrono::seconds(10));
    ASSERT_GE(t, 0) << frozen;
    std::printf("[detect] 2 of 3 %s: rank 0 alone after %.2f s\n", frozen ? "frozen" : "killed", t);
    EXPECT_LE(t, frozen ? 6.0 : 3.5);
    EXPECT_GE(t, 2.5);  // max_silence beyond the suspicion: alone is the weakest evidence
  }
}

// A host's ranks lost at once (4 consecutive of 8, more than watch_count): every one is
// removed, the last ones after the ring re-forms over the survivors.
TEST(DetectCore, ConsecutiveRanksLostAtOnceAreAllRemoved) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  for (int r : {4, 5, 6, 7}) c.crash(r);
  double t = c.run_until(
      [&] {
        for (int r = 0; r < 4; ++r) {
          if (c.core(r).generation()->live != std::vector<int32_t>{0, 1, 2, 3}) return false;
        }
        return true;
      },
      std::chrono::seconds(10));
  ASSERT_GE(t, 0);
  EXPECT_LE(t, 4.0);
}

// Cut off from its peers but not from the store, the rank of 3 suspects both others, and nobody
// seconds it: it would confirm them alone, but they confirm it first (two watchers, within the
// suspicion time) and its late proposal returns their generation: it is evicted, not them.
TEST(DetectCore, ACutOffRankOfThreeIsEvictedNotItsPeers) {
  Cluster c(3);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  c.cut(0);
  ASSERT_GE(c.run_until([&] { return c.all_agree(1, {0}); }, std::chrono::seconds(5)), 0);
  ASSERT_GE(c.run_until([&] { return c.core(0).evicted(); }, std::chrono::seconds(10)), 0);
  c.run_until([] { return false; }, std::chrono::seconds(5));
  for (int r : {1, 2}) {
    EXPECT_EQ(c.core(r).generation()->number, 1u) << r;
    EXPECT_EQ(c.core(r).generation()->live, (std::vector<int32_t>{1, 2})) << r;
  }
  EXPECT_EQ(c.core(0).generation()->live, (std::vector<int32_t>{1, 2}));
}

// A rank stopped long enough to be removed learns it at once when it runs again: its first tick
// after the gap reads the generations decided meanwhile from the store, even when nobody is left
// to tell it (here the others are silent too, as after the job finished).
TEST(DetectCore, AStoppedRankLearnsOfItsRemovalAsSoonAsItRunsAgain) {
  Cluster c(3);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  c.stop(1);
  ASSERT_GE(c.run_until([&] { return c.all_agree(1, {1}); }, std::chrono::seconds(5)), 0);
  c.stop(0);
  c.stop(2);
  c.run_until([] { return false; }, std::chrono::seconds(3));
  c.resume(1);
  double t = c.run_until([&] { return c.core(1).evicted(); }, std::chrono::seconds(5));
  ASSERT_GE(t, 0);
  EXPECT_LE(t, 0.05);
  EXPECT_EQ(c.core(1).generation()->number, 1u);
  EXPECT_EQ(c.core(1).counters().proposals, 0u);  // it removed nobody on its way out
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
    for (const Event& e : c.events(r))
      if (e.kind == Event::Kind::kGeneration) gen = &e;
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
  for (int i = 0; i < 10; ++i) {
    Message m = message(MsgType::kSuspect, 1, 2, 1'000'000 + i, c.clock().now());
    m.verdicts = {Verdict{3, Reason::kUnresponsive, ""}};
    EXPECT_TRUE(c.core(2).on_message(m, c.clock().now()));
  }
  c.run_until([] { return false; }, std::chrono::seconds(3));
  EXPECT_EQ(c.core(2).counters().confirmations, 0u);
  EXPECT_EQ(c.core(0).generation()->number, 0u);
}

// Finding 1: ICMP port unreachable is unauthenticated. A flood of refusals on every watcher of a
// healthy rank (which keeps acking) makes them probe faster but never suspect or evict it.
TEST(DetectCore, SpoofedRefusalsNeverEvictAHealthyRank) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  for (int i = 0; i < 500; ++i) {  // 5 s, one spoofed refusal per watcher every 10 ms
    for (int w : {0, 1, 2}) c.core(w).on_unreachable(3, c.clock().now());
    c.step();
  }
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(c.core(r).generation()->number, 0u) << r;
    EXPECT_EQ(c.core(r).counters().confirmations, 0u) << r;
  }
  EXPECT_GE(c.core(2).counters().refusals, 500u);
  EXPECT_EQ(c.core(2).counters().suspicions, 0u);
  EXPECT_GT(c.core(2).counters().pings_sent, 2u * 500 / 10);  // faster probing
}

// ...while a real crash (refusals and silence) is still found fast, by two watchers.
TEST(DetectCore, RefusalAndSilenceFindAKilledRankFast) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  c.crash(3);
  double t = c.run_until([&] { return c.all_agree(1, {3}); }, std::chrono::seconds(3));
  ASSERT_GE(t, 0);
  std::printf("[detect] crash found and agreed in %.0f ms (refusal-assisted)\n", t * 1e3);
  EXPECT_LE(t, 0.6);
  EXPECT_GE(c.core(0).counters().confirmations + c.core(1).counters().confirmations +
                c.core(2).counters().confirmations,
            2u);
}

// Finding 3 (within a run): everything a frozen rank said before freezing, replayed to its
// watchers, is dropped and counted; the rank is still removed within the usual bound.
TEST(DetectCore, ReplayedAcksDoNotKeepAFrozenRankAlive) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(3));
  std::vector<Message> recorded = c.sent(5);
  ASSERT_GT(recorded.size(), 50u);
  c.stop(5);
  size_t next = 0;
  double t = c.run_until(
      [&] {
        for (int k = 0; k < 5; ++k, ++next) {  // 500 replayed datagrams per second
          const Message& m = recorded[next % recorded.size()];
          if (m.to != 5) c.inject(m.to, m);
        }
        return c.all_agree(1, {5});
      },
      std::chrono::seconds(5));
  ASSERT_GE(t, 0);
  EXPECT_LE(t, 3.0);
  uint64_t replay = 0, stale = 0;
  for (int r : {2, 3, 4}) {
    replay += c.core(r).counters().dropped_replay;
    stale += c.core(r).counters().dropped_stale;
  }
  EXPECT_GT(replay, 0u);
  EXPECT_EQ(c.core(0).generation()->removed[0].reason, Reason::kUnresponsive);
}

// Pings are answered once: a duplicate, an old one, one for another rank, or one held back past
// the freshness window gets no ack (no reflection, no state).
TEST(DetectCore, OnlyFreshPingsAddressedHereAreAnswered) {
  ManualClock clock(TimePoint{} + std::chrono::hours(1));
  CoreOptions o;
  o.rank = 2;
  o.world_size = 4;
  DetectorCore core(o, std::make_shared<const Generation>(Generation::initial(4)), clock.now());
  auto answered = [&](const Message& m) {
    bool admitted = core.on_message(m, clock.now());
    auto out = core.take_outbox();
    bool acked = std::any_of(out.begin(), out.end(),
                             [](const Outgoing& x) { return x.msg.type == MsgType::kAck; });
    EXPECT_EQ(admitted, acked);
    return acked;
  };
  Message first = message(MsgType::kPing, 1, 2, 10, clock.now());
  EXPECT_TRUE(answered(first));
  EXPECT_FALSE(answered(first));  // duplicate
  EXPECT_EQ(core.counters().dropped_replay, 1u);
  clock.advance(milliseconds(100));
  EXPECT_FALSE(answered(message(MsgType::kPing, 1, 3, 11, clock.now())));  // for rank 3
  EXPECT_FALSE(answered(message(MsgType::kPing, 2, 2, 11, clock.now())));  // "from" self
  EXPECT_EQ(core.counters().dropped_misdirected, 2u);
  clock.advance(milliseconds(100));
  EXPECT_TRUE(answered(message(MsgType::kPing, 1, 2, 200, clock.now())));
  EXPECT_FALSE(answered(message(MsgType::kPing, 1, 2, 100, clock.now())));  // 100 below top
  EXPECT_EQ(core.counters().dropped_replay, 2u);
  Message held = message(MsgType::kPing, 1, 2, 201, clock.now());
  clock.advance(o.freshness_window + milliseconds(300));
  EXPECT_FALSE(answered(held));  // captured, held back, replayed
  EXPECT_EQ(core.counters().dropped_stale, 1u);
  EXPECT_TRUE(answered(message(MsgType::kPing, 1, 2, 202, clock.now())));
}

// An ack counts only as the answer to a recent ping of ours: a fresh ack echoing an old ping is
// stale evidence and keeps nobody alive.
TEST(DetectCore, AcksEchoingOldPingsAreStale) {
  ManualClock clock(TimePoint{} + std::chrono::hours(1));
  CoreOptions o;
  o.rank = 0;
  o.world_size = 3;
  DetectorCore core(o, std::make_shared<const Generation>(Generation::initial(3)), clock.now());
  TimePoint ping_at = clock.now();
  clock.advance(o.freshness_window + seconds(1));
  Message ack = message(MsgType::kAck, 1, 0, 1, clock.now());
  ack.echo_seq = 1;
  ack.echo_time_ns = ping_at.time_since_epoch().count();
  EXPECT_FALSE(core.on_message(ack, clock.now()));
  EXPECT_EQ(core.counters().dropped_stale, 1u);
  EXPECT_EQ(core.counters().acks_received, 0u);
}

// Finding 4, the rule: kFlagHard confirms only a rank's announcement about itself. The same flag
// on a claim about another rank, even from one of its watchers, is one suspicion; from a
// non-watcher it is ignored.
TEST(DetectCore, HardFlagConfirmsOnlyASelfAnnouncement) {
  Cluster c(8);
  c.run_until([] { return false; }, std::chrono::seconds(2));
  uint64_t seq = 1'000'000;
  for (int i = 0; i < 20; ++i) {
    for (int from : {1, 6}) {  // 1 watches 3 (with 0 and 2); 6 does not
      Message m = message(MsgType::kSuspect, from, 2, ++seq, c.clock().now());
      m.flags = kFlagHard;
      m.verdicts = {Verdict{3, Reason::kCrash, ""}};
      c.inject(2, m);
    }
    c.step();
  }
  c.run_until([] { return false; }, std::chrono::seconds(2));
  EXPECT_EQ(c.core(2).counters().confirmations, 0u);
  EXPECT_EQ(c.core(2).counters().ignored_claims, 20u);
  EXPECT_EQ(c.core(0).generation()->number, 0u);
  // Without the flag, a rank's claim about itself is nothing either.
  Message quiet = message(MsgType::kSuspect, 3, 2, ++seq, c.clock().now());
  quiet.verdicts = {Verdict{3, Reason::kCrash, ""}};
  c.inject(2, quiet);
  EXPECT_EQ(c.core(2).counters().confirmations, 0u);
  // Rank 3 announcing its own failure: one datagram suffices.
  Message self = message(MsgType::kSuspect, 3, 2, ++seq, c.clock().now());
  self.flags = kFlagHard;
  self.verdicts = {Verdict{3, Reason::kHang, "step"}};
  c.inject(2, self);
  EXPECT_EQ(c.core(2).counters().confirmations, 1u);
  ASSERT_GE(c.run_until([&] { return c.all_agree(1, {3}); }, std::chrono::seconds(1)), 0);
  EXPECT_EQ(c.core(0).generation()->removed[0].reason, Reason::kHang);
}

// A watcher that hears from the peer again withdraws its report: an old suspicion cannot pair
// with a later one of another watcher.
TEST(DetectCore, RetractedReportDoesNotCount) {
  for (bool retract : {false, true}) {
    ManualClock clock(TimePoint{} + std::chrono::hours(1));
    CoreOptions o;
    o.rank = 2;
    o.world_size = 8;
    DetectorCore core(o, std::make_shared<const Generation>(Generation::initial(8)), clock.now());
    Message s = message(MsgType::kSuspect, 1, 2, 1, clock.now());
    s.verdicts = {Verdict{3, Reason::kUnresponsive, ""}};
    ASSERT_TRUE(core.on_message(s, clock.now()));
    if (retract) {
      Message r = message(MsgType::kSuspect, 1, 2, 2, clock.now());
      r.flags = kFlagRetract;
      r.verdicts = s.verdicts;
      ASSERT_TRUE(core.on_message(r, clock.now()));
    }
    for (int i = 0; i < 300; ++i) {  // 3 s without acks: rank 2 suspects 3, 4 and 5 itself
      clock.advance(milliseconds(10));
      core.tick(clock.now());
    }
    EXPECT_GE(core.counters().suspicions, 3u);
    EXPECT_EQ(core.counters().confirmations, retract ? 0u : 1u) << retract;
  }
}

}  // namespace
}  // namespace resilient::detect
