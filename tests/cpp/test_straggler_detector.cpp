// Cross-rank scoring and the stateful detector, on synthetic windows (no clocks, no processes).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "resilient/straggler/detector.hpp"

namespace resilient::straggler {
namespace {

// A synchronous job: every rank is busy `busy[r]` seconds in compute+host, then waits in the
// collective for the slowest one; the step wall time is the same everywhere.
WindowInput sync_window(const std::vector<double>& busy, int64_t first, int64_t last,
                        double collective_s = 0.0002) {
  WindowInput in;
  in.first_step = first;
  in.last_step = last;
  double slowest = 0;
  for (double b : busy) slowest = std::max(slowest, b);
  for (double b : busy) {
    RankWindow w;
    w.steps = last - first + 1;
    w.phase_s[static_cast<int>(Phase::kCompute)] = 0.8 * b;
    w.phase_s[static_cast<int>(Phase::kWait)] = slowest - b + collective_s;
    w.step_s = slowest + collective_s;
    w.phase_s[static_cast<int>(Phase::kHost)] = w.step_s - w.phase_s[2];
    in.ranks.push_back(w);
  }
  return in;
}

StragglerDetector make(int world, StragglerOptions o = {}) {
  auto d = StragglerDetector::create(o, world);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return std::move(d).value();
}

TEST(StragglerScore, FlagsOnlyTheSlowRankInEveryPhase) {
  auto scores = score_window(sync_window({0.010, 0.010, 0.012, 0.010}, 0, 9), {});
  ASSERT_TRUE(scores.ok());
  for (const RankScore& s : *scores) {
    EXPECT_EQ(s.slow, s.rank == 2) << "rank " << s.rank;
  }
  const RankScore& slow = (*scores)[2];
  EXPECT_NEAR(slow.phases[0].ratio, 1.2, 1e-9);
  EXPECT_NEAR(slow.phases[1].ratio, 1.2, 1e-9);
  EXPECT_TRUE(slow.phases[2].slow) << "the rank that waits least is slow";
  EXPECT_NEAR(slow.phases[2].ratio, 1.2, 1e-9);
  EXPECT_GT(slow.z, 3.5);
  EXPECT_NE(slow.worst_phase, Phase::kWait) << "direct phases take precedence over wait";
}

TEST(StragglerScore, OnePointFiveRuleIgnoresSpread) {
  // Very noisy ranks (the z-score alone would not fire), one 1.6x the median.
  WindowInput in;
  in.last_step = 9;
  for (double c : {1.0, 0.7, 1.3, 1.6, 0.75}) {
    RankWindow w;
    w.steps = 10;
    w.phase_s[0] = c;
    in.ranks.push_back(w);
  }
  auto scores = score_window(in, {});
  ASSERT_TRUE(scores.ok());
  EXPECT_TRUE((*scores)[3].slow);
  EXPECT_LT((*scores)[3].z, 3.5);
  EXPECT_FALSE((*scores)[2].slow) << "1.3x with a wide spread is not a straggler";
}

TEST(StragglerScore, NoisyCollectiveAloneDoesNotNameARank) {
  // Equal busy time, but rank 3's collective finished 1.3 ms sooner (gloo on a loaded host): the
  // implied ratio from the wait deficit is 2x, yet its host time shows it is not slower.
  WindowInput in;
  in.last_step = 9;
  for (double wait : {0.0064, 0.0063, 0.0065, 0.0051}) {
    RankWindow w;
    w.steps = 10;
    w.step_s = 0.0077;
    w.phase_s[static_cast<int>(Phase::kWait)] = wait;
    w.phase_s[static_cast<int>(Phase::kHost)] = 0.0013;
    in.ranks.push_back(w);
  }
  auto scores = score_window(in, {});
  ASSERT_TRUE(scores.ok());
  const PhaseScore& w3 = (*scores)[3].phases[static_cast<int>(Phase::kWait)];
  EXPECT_GT(w3.ratio, 1.5);
  EXPECT_GT(w3.z, 3.5);
  EXPECT_FALSE(w3.slow);
  EXPECT_FALSE((*scores)[3].slow);
  // Without a host measurement the wait z-score alone may name it.
  for (RankWindow& w : in.ranks) w.phase_s[static_cast<int>(Phase::kHost)] = kNotMeasured;
  EXPECT_TRUE((*score_window(in, {}))[3].slow);
}

TEST(StragglerScore, SmallExcessRelativeToStepIsIgnored) {
  // Host time is a sliver of a long step: 2x of 0.1 ms in a 100 ms step does not matter.
  WindowInput in;
  in.last_step = 9;
  for (double h : {0.0001, 0.0001, 0.0002, 0.0001}) {
    RankWindow w;
    w.steps = 10;
    w.phase_s[1] = h;
    w.step_s = 0.1;
    in.ranks.push_back(w);
  }
  auto scores = score_window(in, {});
  ASSERT_TRUE(scores.ok());
  EXPECT_FALSE((*scores)[2].slow);
  EXPECT_NEAR((*scores)[2].phases[1].ratio, 2.0, 1e-9);
}

TEST(StragglerScore, TooFewRanksOrNoDataIsNotScored) {
  auto two = score_window(sync_window({0.01, 0.03}, 0, 9), {});
  ASSERT_TRUE(two.ok());
  EXPECT_FALSE((*two)[1].slow);
  EXPECT_TRUE(std::isnan((*two)[1].ratio));
  WindowInput in = sync_window({0.01, 0.01, 0.03, 0.01}, 0, 9);
  in.ranks[2].steps = 0;  // no completed step from rank 2: it is not scored
  auto scores = score_window(in, {});
  ASSERT_TRUE(scores.ok());
  EXPECT_FALSE((*scores)[2].slow);
  EXPECT_EQ(score_window(WindowInput{}, {}).status().code(), StatusCode::kInvalidArgument);
}

TEST(StragglerDetector, PersistentStragglerNamedWithChangePoint) {
  StragglerDetector d = make(4);
  int64_t step = 0;
  for (int w = 0; w < 5; ++w, step += 10) {
    auto r = d.update(sync_window({0.01, 0.01, 0.01, 0.01}, step, step + 9));
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->reports.empty());
  }
  int persistent_window = -1;
  for (int w = 0; w < 6; ++w, step += 10) {
    auto r = d.update(sync_window({0.01, 0.01, 0.01, 0.012}, step, step + 9));
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->scores[3].slow);
    if (w < 2) {  // slow windows are scored but reported only from the third (report_after)
      EXPECT_TRUE(r->reports.empty());
      continue;
    }
    ASSERT_EQ(r->reports.size(), 1u);
    const StragglerReport& rep = r->reports[0];
    EXPECT_EQ(rep.rank, 3);
    EXPECT_EQ(rep.since_step, 50);
    EXPECT_EQ(rep.slow_streak, w + 1);
    EXPECT_NEAR(rep.ratio, 1.2, 1e-9);
    EXPECT_NEAR(rep.self_ratio, 1.2, 1e-9) << "versus its own clean baseline";
    if (!r->newly_persistent.empty()) persistent_window = w;
    EXPECT_EQ(rep.persistent, persistent_window >= 0);
  }
  EXPECT_EQ(persistent_window, 3);
  EXPECT_NE(d.update(sync_window({0.01, 0.01, 0.01, 0.012}, step, step + 9))
                ->reports[0]
                .to_string()
                .find("rank 3 persistent straggler"),
            std::string::npos);
}

TEST(StragglerDetector, SingleSlowWindowIsScoredButNotReported) {
  StragglerDetector d = make(4);
  auto r = d.update(sync_window({0.01, 0.03, 0.01, 0.01}, 0, 9));  // one 3x window
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->scores[1].slow);
  EXPECT_TRUE(r->reports.empty());
  for (int w = 1; w < 10; ++w) {
    r = d.update(sync_window({0.01, 0.01, 0.01, 0.01}, w * 10, w * 10 + 9));
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->reports.empty());
  }
  EXPECT_DOUBLE_EQ(d.cusum_state(1).sum, 0.0);
}

TEST(StragglerDetector, ShortSpikeIsReportedTransientAndRecovers) {
  StragglerOptions o;
  o.report_after = 2;
  StragglerDetector d = make(4, o);
  ASSERT_TRUE(d.update(sync_window({0.01, 0.03, 0.01, 0.01}, 0, 9)).ok());
  auto r = d.update(sync_window({0.01, 0.012, 0.01, 0.01}, 10, 19));
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->reports.size(), 1u);
  EXPECT_EQ(r->reports[0].rank, 1);
  EXPECT_FALSE(r->reports[0].persistent) << "S = 1.5 + 1.4 = 2.9 < 5";
  EXPECT_EQ(r->reports[0].since_step, 0);
  for (int w = 2; w < 12; ++w) {
    r = d.update(sync_window({0.01, 0.01, 0.01, 0.01}, w * 10, w * 10 + 9));
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->reports.empty());
    EXPECT_TRUE(r->newly_persistent.empty());
  }
  EXPECT_DOUBLE_EQ(d.cusum_state(1).sum, 0.0);
}

TEST(StragglerDetector, ReportAfterOneReportsTheFirstSlowWindow) {
  StragglerOptions o;
  o.report_after = 1;
  StragglerDetector d = make(4, o);
  auto r = d.update(sync_window({0.01, 0.03, 0.01, 0.01}, 0, 9));
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->reports.size(), 1u);
  EXPECT_FALSE(r->reports[0].persistent);
  EXPECT_NE(r->reports[0].to_string().find("rank 1 transient straggler"), std::string::npos);
}

TEST(StragglerDetector, RecoveryIsReported) {
  StragglerDetector d = make(4);
  int64_t step = 0;
  for (int w = 0; w < 4; ++w, step += 10)
    d.update(sync_window({0.02, 0.01, 0.01, 0.01}, step, step + 9));
  EXPECT_TRUE(d.cusum_state(0).persistent);
  bool recovered = false;
  for (int w = 0; w < 20 && !recovered; ++w, step += 10) {
    auto r = d.update(sync_window({0.01, 0.01, 0.01, 0.01}, step, step + 9));
    ASSERT_TRUE(r.ok());
    recovered = !r->recovered.empty() && r->recovered[0] == 0;
  }
  EXPECT_TRUE(recovered);
}

TEST(StragglerDetector, NoFalsePositivesUnderJitter) {
  // 2,000 windows of 8 ranks with 3% multiplicative noise: nobody is ever named.
  StragglerDetector d = make(8);
  std::mt19937 rng(1234);
  std::normal_distribution<double> noise(1.0, 0.03);
  int named = 0;
  for (int w = 0; w < 2000; ++w) {
    std::vector<double> busy(8);
    for (double& b : busy) b = 0.01 * noise(rng);
    auto r = d.update(sync_window(busy, w * 10, w * 10 + 9));
    ASSERT_TRUE(r.ok());
    named += static_cast<int>(r->reports.size());
  }
  EXPECT_EQ(named, 0);
}

TEST(StragglerDetector, RejectsMismatchedInput) {
  EXPECT_FALSE(StragglerDetector::create({}, 0).ok());
  StragglerOptions bad;
  bad.min_ratio = 0.9;
  EXPECT_EQ(StragglerDetector::create(bad, 4).status().code(), StatusCode::kInvalidArgument);
  StragglerDetector d = make(4);
  EXPECT_EQ(d.update(sync_window({0.01, 0.01}, 0, 9)).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(d.update(sync_window({0.01, 0.01, 0.01, 0.01}, 0, 9)).ok());
  EXPECT_FALSE(d.update(sync_window({0.01, 0.01, 0.01, 0.01}, 5, 14)).ok()) << "overlaps";
  d.reset();
  EXPECT_TRUE(d.update(sync_window({0.01, 0.01, 0.01, 0.01}, 0, 9)).ok());
  EXPECT_THROW(d.cusum_state(4), std::logic_error);
}

}  // namespace
}  // namespace resilient::straggler
