// Unit tests of the detector's pieces: wire codec + HMAC, phi estimator, membership records and
// the store CAS, ring watch sets, and the hang watchdog.
#include <gtest/gtest.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstdlib>
#include <cstring>
#include <random>

#include "resilient/detect/core.hpp"
#include "resilient/detect/freshness.hpp"
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
  m.to = 2;
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
  m.run = run_hash("");
  EXPECT_EQ(*back, m);
  Codec run_a("0123456789abcdef-key", job_id("job"), "run-a");
  m.echo_seq = 98;
  m.echo_time_ns = -5;
  back = run_a.decode(run_a.encode(m));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  m.run = run_hash("run-a");
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

// A datagram of the version 1 layout (no run, no destination), authenticated with the job key
// as version 1 did: dropped as another version, never parsed as version 2.
std::string v1_datagram(const std::string& key, uint64_t job) {
  std::string out;
  auto put = [&](auto v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(uint32_t{0x54445352});
  put(uint8_t{1});
  put(static_cast<uint8_t>(MsgType::kAck));
  put(uint16_t{0});
  put(job);
  put(int32_t{3});       // from
  put(uint64_t{0});      // generation
  put(uint64_t{7});      // seq
  put(int64_t{123});     // time_ns
  put(uint64_t{0});      // step
  put(uint16_t{0});      // no verdicts
  out.append(64, '\0');  // pad: as long as a version 2 header
  unsigned char tag[kMacSize];
  unsigned int len = kMacSize;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(out.data()), out.size(), tag, &len);
  out.append(reinterpret_cast<const char*>(tag), kMacSize);
  return out;
}

TEST(DetectWire, OtherVersionsAreDroppedNotMisparsed) {
  const std::string key = "0123456789abcdef-key";
  Codec codec(key, job_id("job"));
  DropReason why;
  EXPECT_FALSE(codec.decode(v1_datagram(key, job_id("job")), &why).ok());
  EXPECT_EQ(why, DropReason::kBadVersion);
  std::string d = codec.encode(sample());
  for (uint8_t v : {0, 1, 3, 255}) {
    std::string t = d;
    t[4] = static_cast<char>(v);
    EXPECT_FALSE(codec.decode(t, &why).ok());
    EXPECT_EQ(why, DropReason::kBadVersion) << int(v);
  }
  EXPECT_EQ(static_cast<uint8_t>(d[4]), kWireVersion);
  EXPECT_TRUE(codec.decode(d).ok());
}

// Finding 3 (across runs): the same key in another run authenticates nothing; the run field
// cannot be rewritten either (the MAC key depends on the run id).
TEST(DetectWire, TheMacIsScopedToOneRun) {
  const std::string key = "0123456789abcdef-key";
  Codec run_a(key, job_id("job"), "run-a");
  Codec run_b(key, job_id("job"), "run-b");
  std::string d = run_a.encode(sample());
  DropReason why;
  EXPECT_FALSE(run_b.decode(d, &why).ok());
  EXPECT_EQ(why, DropReason::kOtherRun);
  uint64_t b = run_hash("run-b");
  std::memcpy(d.data() + 16, &b, sizeof b);  // relabel as run b
  EXPECT_FALSE(run_b.decode(d, &why).ok());
  EXPECT_EQ(why, DropReason::kBadMac);
  // The destination is authenticated: redirecting a datagram to another rank breaks the MAC.
  std::string e = run_a.encode(sample());
  int32_t to = 5;
  std::memcpy(e.data() + 28, &to, sizeof to);
  EXPECT_FALSE(run_a.decode(e, &why).ok());
  EXPECT_EQ(why, DropReason::kBadMac);
}

TEST(DetectFreshness, DuplicatesOldNumbersAndHeldBackDatagramsAreRefused) {
  ReplayGuard g(seconds(5));
  TimePoint t = TimePoint{} + std::chrono::hours(2);
  const int64_t skew = 7'000'000'000'000;  // the sender's clock: another boot, far ahead
  auto sent = [&](TimePoint at) { return at.time_since_epoch().count() + skew; };
  EXPECT_EQ(g.admit(1, 10, sent(t), t), Admission::kAccept);
  EXPECT_EQ(g.admit(1, 10, sent(t), t), Admission::kDuplicate);
  EXPECT_EQ(g.admit(1, 0, sent(t), t), Admission::kOldSeq);
  EXPECT_EQ(g.admit(1, 12, sent(t), t + milliseconds(1)), Admission::kAccept);
  EXPECT_EQ(g.admit(1, 11, sent(t), t + milliseconds(2)), Admission::kAccept);  // reordered
  EXPECT_EQ(g.admit(1, 11, sent(t), t + milliseconds(2)), Admission::kDuplicate);
  EXPECT_EQ(g.admit(1, 200, sent(t), t + milliseconds(3)), Admission::kAccept);
  EXPECT_EQ(g.admit(1, 136, sent(t), t + milliseconds(3)), Admission::kOldSeq);  // 64 below
  EXPECT_EQ(g.admit(1, 137, sent(t), t + milliseconds(3)), Admission::kAccept);  // 63 below
  EXPECT_EQ(g.admit(2, 12, sent(t), t), Admission::kAccept);  // senders are separate
  // Held back: sent at t, delivered 6 s later with a fresh number (captured and replayed).
  EXPECT_EQ(g.admit(1, 201, sent(t), t + seconds(6)), Admission::kStale);
  EXPECT_EQ(g.admit(1, 201, sent(t + seconds(6)), t + seconds(6)), Admission::kAccept);
  // Delays within the window are fine, and a slow rise (clock rate) is followed.
  EXPECT_EQ(g.admit(1, 202, sent(t + seconds(6)), t + seconds(9)), Admission::kAccept);
  TimePoint now = t + seconds(9);
  int64_t lag = 0;
  for (uint64_t seq = 203; seq < 203 + 3600; ++seq) {  // an hour, sender 0.5 ms/s slower
    now += seconds(1);
    lag += 500'000;
    ASSERT_EQ(g.admit(1, seq, sent(now) - lag, now), Admission::kAccept) << seq;
  }
  EXPECT_EQ(g.admit(1, 9000, sent(now) - lag - 6'000'000'000, now), Admission::kStale);
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
  Generation g =
      Generation::initial(100000).next({{5, Reason::kCrash, ""}, {77, Reason::kHang, "step"}});
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
  EXPECT_EQ(ring_successors(live, 3, 10).size(), 4u);                      // never self
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
  EXPECT_TRUE(w.check(t + milliseconds(3000)).has_value());  // re-armed by progress
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

TEST(DetectOptions, WatchdogValidatesAndReadsTheEnvironment) {
  EXPECT_TRUE(WatchdogOptions{}.validate().ok());
  WatchdogOptions o;
  o.safety_factor = 0.5;
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
  o = WatchdogOptions{};
  o.section_limits["io"] = -milliseconds(1);
  EXPECT_NE(o.validate().message().find("'io'"), std::string::npos);
  ::setenv("RESILIENT_DETECT_HANG_STARTUP_S", "90", 1);
  Result<WatchdogOptions> env = WatchdogOptions::from_env();
  ASSERT_TRUE(env.ok()) << env.status().to_string();
  EXPECT_EQ(env->startup_limit, seconds(90));
  ::setenv("RESILIENT_DETECT_HANG_STARTUP_S", "later", 1);
  Status bad = WatchdogOptions::from_env().status();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("RESILIENT_DETECT_HANG_STARTUP_S='later'"), std::string::npos);
  ::unsetenv("RESILIENT_DETECT_HANG_STARTUP_S");
  ::setenv("RESILIENT_DETECT_HANG_SAFETY_FACTOR", "0.9", 1);
  EXPECT_EQ(WatchdogOptions::from_env().status().code(), StatusCode::kInvalidArgument);
  ::unsetenv("RESILIENT_DETECT_HANG_SAFETY_FACTOR");
}

TEST(DetectOptions, CoreValidatesAndReadsTheEnvironment) {
  EXPECT_TRUE(CoreOptions{}.validate().ok());
  CoreOptions o;
  o.rank = 4;
  o.world_size = 4;
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
  o = CoreOptions{};
  o.heartbeat_interval = Duration::zero();
  EXPECT_NE(o.validate().message().find("heartbeat_interval"), std::string::npos);
  ::setenv("RESILIENT_DETECT_HEARTBEAT_MS", "40", 1);
  Result<CoreOptions> env = CoreOptions::from_env(2, 8);
  ASSERT_TRUE(env.ok()) << env.status().to_string();
  EXPECT_EQ(env->heartbeat_interval, milliseconds(40));
  EXPECT_EQ(env->refused_silence, milliseconds(120));  // follows the heartbeat
  ::setenv("RESILIENT_DETECT_WATCH_COUNT", "0", 1);
  Status bad = CoreOptions::from_env(2, 8).status();
  EXPECT_NE(bad.message().find("RESILIENT_DETECT_WATCH_COUNT"), std::string::npos);
  ::setenv("RESILIENT_DETECT_WATCH_COUNT", "three", 1);
  EXPECT_EQ(CoreOptions::from_env(2, 8).status().code(), StatusCode::kInvalidArgument);
  ::unsetenv("RESILIENT_DETECT_WATCH_COUNT");
  ::unsetenv("RESILIENT_DETECT_HEARTBEAT_MS");
}

}  // namespace
}  // namespace resilient::detect
