// Pure recovery decisions and options parsing.
#include <gtest/gtest.h>

#include <cstdlib>

#include "resilient/comm/recovery_plan.hpp"

namespace resilient::comm {
namespace {

using namespace std::chrono_literals;

RecoveryPlan plan_of(NcclCapabilities caps, CommOptions o, bool alive, bool joiners) {
  auto p = plan_recovery(caps, o, alive, joiners);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? *p : RecoveryPlan{};
}

TEST(PlanRecovery, ChoosesByCapabilities) {
  CommOptions o;
  EXPECT_EQ(plan_of({true, true}, o, true, false),
            (RecoveryPlan{Teardown::kRevoke, Rebuild::kShrink}));
  EXPECT_EQ(plan_of({true, false}, o, true, false),
            (RecoveryPlan{Teardown::kShrinkAbort, Rebuild::kShrink}));
  EXPECT_EQ(plan_of({false, false}, o, true, false),
            (RecoveryPlan{Teardown::kAbort, Rebuild::kReinit}));
  EXPECT_EQ(plan_of({true, true}, o, true, true),
            (RecoveryPlan{Teardown::kRevoke, Rebuild::kReinit}));
  EXPECT_EQ(plan_of({true, false}, o, true, true),
            (RecoveryPlan{Teardown::kAbort, Rebuild::kReinit}));
  EXPECT_EQ(plan_of({true, true}, o, false, false),
            (RecoveryPlan{Teardown::kNone, Rebuild::kReinit}));
}

TEST(PlanRecovery, FollowsOptions) {
  CommOptions o;
  o.rebuild_mode = RebuildMode::kReinit;
  EXPECT_EQ(plan_of({true, true}, o, true, false),
            (RecoveryPlan{Teardown::kRevoke, Rebuild::kReinit}));
  o.revoke = Feature::kOff;
  EXPECT_EQ(plan_of({true, true}, o, true, false),
            (RecoveryPlan{Teardown::kAbort, Rebuild::kReinit}));
  o.revoke = Feature::kOn;
  EXPECT_EQ(plan_recovery({true, false}, o, true, false).status().code(), StatusCode::kUnavailable);
  CommOptions s;
  s.rebuild_mode = RebuildMode::kShrink;
  EXPECT_EQ(plan_recovery({false, true}, s, true, false).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(plan_recovery({true, true}, s, true, true).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(plan_recovery({true, true}, s, false, false).status().code(),
            StatusCode::kFailedPrecondition);
}

TEST(SurvivorRank, ClosesGapsLikeShrink) {
  EXPECT_EQ(*survivor_rank(0, 4, {3}), 0);
  EXPECT_EQ(*survivor_rank(3, 4, {1}), 2);
  EXPECT_EQ(*survivor_rank(5, 8, {7, 0, 2}), 3);
  EXPECT_EQ(*survivor_rank(2, 4, {}), 2);
  EXPECT_EQ(survivor_rank(1, 4, {1}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(survivor_rank(1, 4, {4}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(survivor_rank(1, 4, {2, 2}).status().code(), StatusCode::kInvalidArgument);
}

TEST(CommOptions, EnvironmentOverrides) {
  ::setenv("RESILIENT_COMM_INIT_TIMEOUT_S", "2.5", 1);
  ::setenv("RESILIENT_COMM_REBUILD", "reinit", 1);
  ::setenv("RESILIENT_COMM_REVOKE", "off", 1);
  ::setenv("RESILIENT_COMM_POLL_INTERVAL_US", "50", 1);
  Result<CommOptions> o = CommOptions::from_env();
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->init_timeout, 2500ms);
  EXPECT_EQ(o->rebuild_mode, RebuildMode::kReinit);
  EXPECT_EQ(o->revoke, Feature::kOff);
  EXPECT_EQ(o->poll_interval, 50us);
  ::setenv("RESILIENT_COMM_REBUILD", "sometimes", 1);
  Status bad = CommOptions::from_env().status();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("RESILIENT_COMM_REBUILD='sometimes'"), std::string::npos);
  ::setenv("RESILIENT_COMM_REBUILD", "auto", 1);
  ::setenv("RESILIENT_COMM_INIT_TIMEOUT_S", "-1", 1);
  bad = CommOptions::from_env().status();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("RESILIENT_COMM_INIT_TIMEOUT_S"), std::string::npos);
  ::setenv("RESILIENT_COMM_INIT_TIMEOUT_S", "soon", 1);
  EXPECT_EQ(CommOptions::from_env().status().code(), StatusCode::kInvalidArgument);
  for (const char* n : {"RESILIENT_COMM_INIT_TIMEOUT_S", "RESILIENT_COMM_REBUILD",
                        "RESILIENT_COMM_REVOKE", "RESILIENT_COMM_POLL_INTERVAL_US"}) {
    ::unsetenv(n);
  }
  EXPECT_EQ(CommOptions::from_env()->rebuild_mode, RebuildMode::kAuto);
}

TEST(CommOptions, ValidateNamesTheBadField) {
  EXPECT_TRUE(CommOptions{}.validate().ok());
  CommOptions o;
  o.store_timeout = Duration::zero();
  EXPECT_NE(o.validate().message().find("store_timeout"), std::string::npos);
  o = CommOptions{};
  o.poll_interval = -1us;
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
  o = CommOptions{};
  o.name.clear();
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace resilient::comm
