// Robust statistics and the CUSUM change-point detector: deterministic unit tests.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "resilient/straggler/cusum.hpp"
#include "resilient/straggler/options.hpp"
#include "resilient/straggler/stats.hpp"

namespace resilient::straggler {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST(StragglerStats, MedianOddEvenAndEmpty) {
  EXPECT_DOUBLE_EQ(median(std::vector<double>{3, 1, 2}), 2.0);
  EXPECT_DOUBLE_EQ(median(std::vector<double>{4, 1, 3, 2}), 2.5);
  EXPECT_DOUBLE_EQ(median(std::vector<double>{7}), 7.0);
  EXPECT_TRUE(std::isnan(median(std::vector<double>{})));
}

TEST(StragglerStats, MedianSkipsNonFinite) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_DOUBLE_EQ(median(std::vector<double>{kNaN, 5, inf, 1, 3}), 3.0);
  EXPECT_TRUE(std::isnan(median(std::vector<double>{kNaN, kNaN})));
}

TEST(StragglerStats, MadIsRobustToOneOutlier) {
  // Deviations from 3: 2,1,0,1,97 -> MAD 1 whatever the outlier's size.
  std::vector<double> v{1, 2, 3, 4, 100};
  EXPECT_DOUBLE_EQ(mad(v, 3.0), 1.0);
  v.back() = 1e9;
  EXPECT_DOUBLE_EQ(mad(v, 3.0), 1.0);
  EXPECT_TRUE(std::isnan(mad(v, kNaN)));
}

TEST(StragglerStats, SummarizeMatchesMedianAndMad) {
  const std::vector<double> v{10, 12, 11, 30, kNaN};
  const RobustSummary s = summarize(v);
  EXPECT_EQ(s.count, 4u);
  EXPECT_DOUBLE_EQ(s.median, 11.5);
  EXPECT_DOUBLE_EQ(s.mad, mad(v, 11.5));
  const RobustSummary empty = summarize(std::vector<double>{});
  EXPECT_EQ(empty.count, 0u);
  EXPECT_TRUE(std::isnan(empty.median));
}

TEST(StragglerStats, RobustScaleFloorAndZ) {
  // Identical values: MAD 0, so the floor (2% of the median) is the scale.
  const RobustSummary same = summarize(std::vector<double>{1, 1, 1, 1});
  EXPECT_DOUBLE_EQ(robust_scale(same, 0.02), 0.02);
  EXPECT_NEAR(robust_z(1.1, same, robust_scale(same, 0.02)), 5.0, 1e-9);
  // A real spread wins over the floor.
  const RobustSummary spread = summarize(std::vector<double>{1, 2, 3, 4, 5});
  EXPECT_DOUBLE_EQ(robust_scale(spread, 0.02), kMadToSigma * 1.0);
  EXPECT_DOUBLE_EQ(robust_z(kNaN, spread, 1.0), 0.0);
  EXPECT_GT(robust_scale(summarize(std::vector<double>{}), 0.02), 0.0);
}

TEST(StragglerStats, RollingHistoryKeepsTheLastValues) {
  RollingHistory h(3);
  EXPECT_TRUE(std::isnan(h.median()));
  for (double x : {1.0, 2.0, kNaN, 3.0, 10.0}) h.push(x);
  EXPECT_EQ(h.size(), 3u);
  EXPECT_EQ(h.values(), (std::vector<double>{2, 3, 10}));
  EXPECT_DOUBLE_EQ(h.median(), 3.0);
  h.clear();
  EXPECT_EQ(h.size(), 0u);
  EXPECT_THROW(RollingHistory(0), std::logic_error);
}

constexpr CusumParams kParams{.drift = 0.5, .threshold = 3.0, .clip = 2.0, .cap = 6.0};

TEST(StragglerCusum, DefaultsNeedSeveralWindows) {
  CusumParams p;  // a maximal (clipped) window adds clip - drift: persistence takes > 2 windows
  EXPECT_GT(p.threshold, 2 * (p.clip - p.drift));
  EXPECT_GE(p.cap, p.threshold);
}

TEST(StragglerCusum, SingleSpikeStaysTransient) {
  CusumParams p = kParams;
  CusumState st;
  // A huge one-window spike is clipped to 2: S = 1.5, below the threshold, then decays.
  CusumEvent ev = cusum_update(st, 100.0, 10, p);
  EXPECT_FALSE(ev.became_persistent);
  EXPECT_DOUBLE_EQ(st.sum, 1.5);
  EXPECT_EQ(st.run_start, 10);
  for (int64_t step = 20; step <= 40; step += 10) cusum_update(st, 0.0, step, p);
  EXPECT_DOUBLE_EQ(st.sum, 0.0);
  EXPECT_EQ(st.run_start, -1);
  EXPECT_FALSE(st.persistent);
}

TEST(StragglerCusum, SustainedShiftBecomesPersistentWithChangePoint) {
  CusumParams p = kParams;
  CusumState st;
  cusum_update(st, 0.0, 0, p);
  cusum_update(st, 0.2, 10, p);  // below the drift: no excursion
  EXPECT_EQ(st.run_start, -1);
  // Evidence 1.3 per window: +0.8 per window.
  int became_at = -1;
  for (int w = 0; w < 6; ++w) {
    CusumEvent ev = cusum_update(st, 1.3, 20 + 10 * w, p);
    if (ev.became_persistent) became_at = w;
  }
  EXPECT_EQ(became_at, 3);  // 0.8, 1.6, 2.4, 3.2
  EXPECT_TRUE(st.persistent);
  EXPECT_EQ(st.run_start, 20);
  EXPECT_EQ(st.flagged_windows, 6);
  EXPECT_LE(st.sum, p.cap);
  // Recovery: S decays by the drift each clean window; the last update reports it.
  bool recovered = false;
  for (int w = 0; w < 20 && !recovered; ++w)
    recovered = cusum_update(st, 0.0, 100 + w, p).recovered;
  EXPECT_TRUE(recovered);
  EXPECT_FALSE(st.persistent);
}

TEST(StragglerCusum, IntermittentShiftAccumulates) {
  CusumParams p = kParams;
  CusumState st;
  bool persistent = false;
  // Slow in 3 windows out of 4 at evidence 1.5: mean increment 0.625 per window.
  for (int w = 0; w < 12; ++w) {
    persistent |= cusum_update(st, w % 4 == 3 ? 0.0 : 1.5, w * 10, p).became_persistent;
  }
  EXPECT_TRUE(persistent);
  EXPECT_EQ(st.run_start, 0);
}

TEST(StragglerOptions, ValidateRejectsInconsistentSettings) {
  StragglerOptions o;
  EXPECT_TRUE(o.validate().ok());
  o.slow_ratio = 1.05;  // below min_ratio 1.1
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
  o = StragglerOptions{};
  o.interval = 0;
  EXPECT_FALSE(o.validate().ok());
  o = StragglerOptions{};
  o.cusum.clip = 0.1;
  EXPECT_FALSE(o.validate().ok());
  o = StragglerOptions{};
  o.min_ranks = 1;
  EXPECT_FALSE(o.validate().ok());
}

TEST(StragglerOptions, EnvironmentOverrides) {
  setenv("RESILIENT_STRAGGLER_INTERVAL", "25", 1);
  setenv("RESILIENT_STRAGGLER_MIN_RATIO", "1.3", 1);
  Result<StragglerOptions> o = StragglerOptions::from_env();
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->interval, 25);
  EXPECT_DOUBLE_EQ(o->min_ratio, 1.3);
  setenv("RESILIENT_STRAGGLER_CUSUM_DRIFT", "abc", 1);
  Status bad = StragglerOptions::from_env().status();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("RESILIENT_STRAGGLER_CUSUM_DRIFT='abc'"), std::string::npos);
  unsetenv("RESILIENT_STRAGGLER_CUSUM_DRIFT");
  setenv("RESILIENT_STRAGGLER_MIN_RATIO", "2", 1);  // above slow_ratio: read, then refused
  ASSERT_TRUE(StragglerOptions::from_env().ok());
  EXPECT_EQ(StragglerOptions::from_env()->validate().code(), StatusCode::kInvalidArgument);
  unsetenv("RESILIENT_STRAGGLER_INTERVAL");
  unsetenv("RESILIENT_STRAGGLER_MIN_RATIO");
  unsetenv("RESILIENT_STRAGGLER_CUSUM_DRIFT");
}

}  // namespace
}  // namespace resilient::straggler
