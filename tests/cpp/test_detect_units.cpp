// Unit tests of the detector's pieces: wire codec + HMAC, phi estimator, membership records and
// the store CAS, ring watch sets, and the hang watchdog.
#include <gtest/gtest.h>

#include <random>

#include "resilient/detect/membership.hpp"
#include "resilient/detect/phi.hpp"
#include "resilient/detect/watchdog.hpp"
#include "resilient/detect/wire.hpp"

namespace resilient::detect {
namespace {
using std::chrono::milliseconds;
using std::chrono::seconds;

Message sample() {
  Message m;
  m.type = MsgType::kGeneration;
  m.flags = kFlagComplete;
  m.from = 7;
  m.generation = 3;
  m.seq = 99;
  m.time_ns = 123456789;
  m.step = 42;
  m.verdicts = {{1, Reason::kCrash, ""}, {5, Reason::kHang, "checkpoint"}};
  return m;
}

TEST(DetectWire, RoundTrip) {
  Codec codec("0123456789abcdef-key", job_id("job"));
  Message m = sample();
  auto back = codec.decode(codec.encode(m));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  m.job = job_id("job");
  EXPECT_EQ(*back, m);
}

TEST(DetectWire, WrongKeyOtherJobAndTamperingAreDropped) {
  Codec a("0123456789abcdef-key", job_id("job"));
  Codec wrong_key("another-key-of-16+", job_id("job"));
  Codec other_job("0123456789abcdef-key", job_id("job2"));
  std::string d = a.encode(sample());
  DropReason why;
  EXPECT_FALSE(wrong_key.decode(d, &why).ok());
  EXPECT_EQ(why, DropReason::kBadMac);
  EXPECT_FALSE(other_job.decode(d, &why).ok());
  EXPECT_EQ(why, DropReason::kOtherJob);
  std::string t = d;
  t[40] ^= 1;  // flip a bit in the body
  EXPECT_FALSE(a.decode(t, &why).ok());
  EXPECT_EQ(why, DropReason::kBadMac);
  EXPECT_FALSE(a.decode(d.substr(0, 20), &why).ok());
  EXPECT_EQ(why, DropReason::kMalformed);
}

TEST(DetectWire, RandomBytesNeverCrash) {
  Codec a("0123456789abcdef-key", job_id("job"));
  std::mt19937 rng(1);
  std::string good = a.encode(sample());
  for (int i = 0; i < 20000; ++i) {
    std::string d = good;
    d.resize(rng() % (good.size() + 8));
    for (int k = 0; k < 3 && !d.empty(); ++k) d[rng() % d.size()] = static_cast<char>(rng());
    (void)a.decode(d);
  }
}

TEST(DetectWire, OversizedVerdictListIsTruncatedAndMarkedIncomplete) {
  Codec a("0123456789abcdef-key", 1);
  Message m = sample();
  m.verdicts.assign(1000, Verdict{3, Reason::kUnresponsive, "x"});
  std::string d = a.encode(m);
  EXPECT_LE(d.size(), kMaxDatagram);
  auto back = a.decode(d);
  ASSERT_TRUE(back.ok());
  EXPECT_LT(back->verdicts.size(), 1000u);
  EXPECT_EQ(back->flags & kFlagComplete, 0);
}

TEST(DetectPhi, RegularHeartbeatsStayLowSilenceRaisesIt) {
  PhiEstimator est;
  TimePoint t{};
  for (int i = 0; i < 100; ++i) {
    t += milliseconds(100);
    est.heartbeat(t);
  }
  EXPECT_LT(est.phi(t + milliseconds(300)), 1.0);
  EXPECT_LT(est.phi(t + milliseconds(1000)), 8.0);
  EXPECT_GT(est.phi(t + milliseconds(2500)), 8.0);
  // Monotone in silence.
  double prev = 0;
  for (int ms = 0; ms < 3000; ms += 50) {
    double p = est.phi(t + milliseconds(ms));
    EXPECT_GE(p, prev);
    prev = p;
  }
}

TEST(DetectPhi, JitteryLinkLearnsALongerThreshold) {
  PhiEstimator calm, jittery;
  TimePoint a{}, b{};
  std::mt19937 rng(3);
  for (int i = 0; i < 100; ++i) {
    a += milliseconds(100);
    calm.heartbeat(a);
    b += milliseconds(100 + static_cast<int>(rng() % 600));
    jittery.heartbeat(b);
  }
  EXPECT_GT(jittery.stddev_ms(), calm.stddev_ms());
  EXPECT_GT(calm.phi(a + milliseconds(2000)), jittery.phi(b + milliseconds(2000)));
}

TEST(DetectMembership, SerializeParseRoundTrip) {
  Generation g = Generation::initial(100000).next({{5, Reason::kCrash, ""}, {77, Reason::kHang, "step"}});
  std::string s = g.serialize();
  EXPECT_LT(s.size(), 100u);  // ranges keep it short
  auto back = Generation::parse(s);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->live, g.live);
  EXPECT_EQ(back->removed, g.removed);
  EXPECT_EQ(back->number, 1u);
  for (const char* bad : {"", "g=1", "g=x;live=;removed=", "g=1;live=3,2;removed=",
                          "g=1;live=1;removed=2:9:", "g=1;live=1-;removed="}) {
    EXPECT_FALSE(Generation::parse(bad).ok()) << bad;
  }
}

TEST(DetectMembership, RingWatchSets) {
  std::vector<int32_t> live = {0, 2, 3, 5, 9};
  EXPECT_EQ(ring_successors(live, 3, 3), (std::vector<int32_t>{5, 9, 0}));
  EXPECT_EQ(ring_successors(live, 9, 2), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(ring_predecessors(live, 0, 3), (std::vector<int32_t>{9, 5, 3}));
  EXPECT_EQ(ring_predecessors(live, 4, 2), (std::vector<int32_t>{3, 2}));  // non-member
  EXPECT_EQ(ring_successors(live, 3, 10).size(), 4u);                        // never self
  EXPECT_TRUE(ring_successors({1}, 1, 3).empty());
}

TEST(DetectMembership, EachGenerationIsDecidedOnce) {
  InMemoryStore store;
  Generation g0 = Generation::initial(8);
  Generation a = g0.next({{3, Reason::kCrash, ""}});
  Generation b = g0.next({{3, Reason::kCrash, ""}, {4, Reason::kUnresponsive, ""}});
  auto da = decide_generation(store, "p", a, seconds(1));
  auto db = decide_generation(store, "p", b, seconds(1));
  ASSERT_TRUE(da.ok() && db.ok());
  EXPECT_EQ(da->live, a.live);
  EXPECT_EQ(db->live, a.live);  // the loser adopts the winner's record
  EXPECT_EQ(read_generation(store, "p", 1, seconds(1))->live, a.live);
  EXPECT_EQ(read_generation(store, "p", 2, seconds(1)).status().code(), StatusCode::kNotFound);
  store.set_unavailable(true);
  EXPECT_EQ(decide_generation(store, "p", b.next({}), seconds(1)).status().code(),
            StatusCode::kUnavailable);
}

TEST(DetectWatchdog, LearnsStepTimeAndFiresOnce) {
  WatchdogOptions o;
  o.min_step_limit = milliseconds(100);
  o.safety_factor = 4;
  TimePoint t{};
  HangWatchdog w(o, t);
  EXPECT_EQ(w.section(), "startup");
  for (uint64_t s = 1; s <= 10; ++s) {
    t += milliseconds(200);
    w.progress(s, t);
  }
  EXPECT_EQ(w.section(), "step");
  EXPECT_EQ(w.limit(), milliseconds(800));
  EXPECT_FALSE(w.check(t + milliseconds(700)).has_value());
  auto h = w.check(t + milliseconds(900));
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->section, "step");
  EXPECT_FALSE(w.check(t + milliseconds(2000)).has_value());  // latched
  w.progress(11, t + milliseconds(2100));
  EXPECT_TRUE(w.check(t + milliseconds(3000)).has_value());   // re-armed by progress
}

TEST(DetectWatchdog, SectionsHaveTheirOwnLimits) {
  WatchdogOptions o;
  o.min_step_limit = milliseconds(100);
  o.startup_limit = seconds(10);
  o.section_limits["checkpoint"] = seconds(60);
  TimePoint t{};
  HangWatchdog w(o, t);
  EXPECT_FALSE(w.check(t + seconds(9)).has_value());
  EXPECT_EQ(w.check(t + seconds(11))->section, "startup");
  for (uint64_t s = 1; s <= 5; ++s) w.progress(s, t += milliseconds(10));
  w.enter("checkpoint", t);
  EXPECT_FALSE(w.check(t + seconds(30)).has_value());
  EXPECT_EQ(w.check(t + seconds(61))->section, "checkpoint");
  w.leave(t + seconds(62));
  o.step_limit_override = seconds(5);
  HangWatchdog w2(o, t);
  for (uint64_t s = 1; s <= 5; ++s) w2.progress(s, t += milliseconds(10));
  EXPECT_EQ(w2.limit(), seconds(5));
}

}  // namespace
}  // namespace resilient::detect
