// CommManager::recover against the fake NCCL table: revoke vs abort by version, shrink vs
// reinit, joiners, and a second failure during the rebuild.
#include <gtest/gtest.h>

#include "resilient/comm/comm_manager.hpp"
#include "test_comm_fake_nccl.hpp"

namespace resilient::comm {
namespace {

using testing::FakeComm;
using testing::FakeNccl;
using namespace std::chrono_literals;

class CommRecoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FakeNccl::current() = &fake_;
    options_.init_timeout = 5s;
    options_.quiesce_timeout = 1s;
    options_.store_timeout = 50ms;
    options_.poll_interval = 10ms;
  }
  void TearDown() override {
    // Every communicator NCCL handed out was aborted or destroyed once the managers are gone:
    // none leaked (the managers are locals of the tests, gone before TearDown).
    for (const auto& c : fake_.comms) {
      EXPECT_TRUE(c->aborted || c->destroyed) << "leaked communicator " << c->id;
    }
    FakeNccl::current() = nullptr;
  }

  std::unique_ptr<CommManager> ready(int rank, int size) {
    auto lib = NcclLibrary::from_table(fake_.table());
    EXPECT_TRUE(lib.ok()) << lib.status().to_string();
    auto m = std::make_unique<CommManager>(*lib, options_, &clock_,
                                           [this](Duration d) { clock_.advance(d); });
    EXPECT_TRUE(m->init(*m->new_unique_id(), size, rank).ok());
    return m;
  }
  // Fails the live communicator as a dead peer would.
  void fail(CommManager& m) {
    FakeNccl::of(m.handle())->async = kNcclRemoteError;
    EXPECT_EQ(m.check().code(), StatusCode::kUnavailable);
  }

  FakeNccl fake_;
  CommOptions options_;
  ManualClock clock_;
  InMemoryStore store_;
};

TEST_F(CommRecoverTest, NewNcclRevokesThenShrinks) {
  fake_.version = nccl_version_code(2, 28, 9);
  auto m = ready(2, 4);
  FakeComm* parent = FakeNccl::of(m->handle());
  fail(*m);
  auto report = m->recover({.generation = 1, .excluded = {1}}, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->plan, (RecoveryPlan{Teardown::kRevoke, Rebuild::kShrink}));
  EXPECT_EQ(fake_.revokes, 1);
  EXPECT_EQ(fake_.shrinks, 1);
  EXPECT_TRUE(parent->revoked);
  EXPECT_TRUE(parent->destroyed);  // destroyed, not finalized, after revoke
  EXPECT_FALSE(parent->aborted);
  FakeComm* child = FakeNccl::of(m->handle());
  EXPECT_EQ(child->shrink_flags, kNcclShrinkDefault);
  EXPECT_EQ(child->excluded, std::vector<int>{1});
  EXPECT_EQ(fake_.last_blocking, 0);
  EXPECT_EQ(m->rank(), 1);
  EXPECT_EQ(m->size(), 3);
  EXPECT_EQ(m->generation(), 1u);
  EXPECT_EQ(m->state(), CommState::kReady);
  EXPECT_EQ(report->teardown, 10ms);  // one poll in progress, then quiescent
  EXPECT_EQ(fake_.use_after_free, 0);
}

TEST_F(CommRecoverTest, NcclWithoutRevokeShrinksWithAbortFlag) {
  fake_.version = nccl_version_code(2, 27, 3);  // shrink, but no revoke
  auto m = ready(0, 4);
  FakeComm* parent = FakeNccl::of(m->handle());
  fail(*m);
  auto report = m->recover({.generation = 1, .excluded = {3}}, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->plan, (RecoveryPlan{Teardown::kShrinkAbort, Rebuild::kShrink}));
  EXPECT_EQ(fake_.revokes, 0);
  EXPECT_EQ(FakeNccl::of(m->handle())->shrink_flags, kNcclShrinkAbort);
  EXPECT_TRUE(parent->aborted);
  EXPECT_EQ(m->size(), 3);
  EXPECT_EQ(m->rank(), 0);
}

TEST_F(CommRecoverTest, RevokeSymbolMissingFallsBackToAbortPath) {
  fake_.has_revoke = false;  // version says yes, library lacks the symbol
  auto m = ready(1, 3);
  fail(*m);
  auto report = m->recover({.generation = 1, .excluded = {0}}, nullptr);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->plan.teardown, Teardown::kShrinkAbort);
}

TEST_F(CommRecoverTest, OldNcclAbortsAndReinitsThroughStore) {
  fake_.version = nccl_version_code(2, 26, 5);  // neither shrink nor revoke
  auto m = ready(3, 4);
  FakeComm* parent = FakeNccl::of(m->handle());
  fail(*m);
  // The new rank 0 (old rank 0) published its id for generation 1.
  ASSERT_TRUE(
      store_
          .set("resilient/comm/default/gen1/nccl_id", std::string("gen1-id").append(121, '\0'), 1s)
          .ok());
  auto report = m->recover({.generation = 1, .excluded = {2}}, &store_);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->plan, (RecoveryPlan{Teardown::kAbort, Rebuild::kReinit}));
  EXPECT_TRUE(parent->aborted);
  EXPECT_EQ(fake_.shrinks, 0);
  EXPECT_EQ(FakeNccl::of(m->handle())->id, "gen1-id");
  EXPECT_EQ(m->rank(), 2);
  EXPECT_EQ(m->size(), 3);
}

TEST_F(CommRecoverTest, ReinitNeedsAStore) {
  fake_.version = nccl_version_code(2, 26, 5);
  auto m = ready(0, 2);
  auto report = m->recover({.generation = 1, .excluded = {1}}, nullptr);
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fake_.aborts, 0);  // nothing torn down
}

TEST_F(CommRecoverTest, RevokeAndReinitWhenOptionsSayReinit) {
  options_.rebuild_mode = RebuildMode::kReinit;
  auto m = ready(0, 3);
  FakeComm* parent = FakeNccl::of(m->handle());
  auto report = m->recover({.generation = 5, .excluded = {2}}, &store_);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->plan, (RecoveryPlan{Teardown::kRevoke, Rebuild::kReinit}));
  EXPECT_TRUE(parent->revoked);
  EXPECT_TRUE(parent->destroyed);
  EXPECT_EQ(fake_.unique_ids, 2);  // new rank 0 created a fresh id for generation 5
  EXPECT_EQ(m->generation(), 5u);
}

TEST_F(CommRecoverTest, RevokeOffAborts) {
  options_.revoke = Feature::kOff;
  auto m = ready(0, 3);
  auto report = m->recover({.generation = 1, .excluded = {2}}, nullptr);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->plan.teardown, Teardown::kShrinkAbort);
  EXPECT_EQ(fake_.revokes, 0);
}

TEST_F(CommRecoverTest, RevokeThatNeverQuiescesFallsBackToAbortAndReinit) {
  fake_.revoke_polls = -1;
  auto m = ready(0, 2);
  FakeComm* parent = FakeNccl::of(m->handle());
  auto report = m->recover({.generation = 1, .excluded = {1}}, &store_);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_TRUE(report->fell_back_to_abort);
  EXPECT_EQ(report->plan.rebuild, Rebuild::kReinit);
  EXPECT_TRUE(parent->aborted);
  EXPECT_GE(report->teardown, options_.quiesce_timeout);
  EXPECT_EQ(m->size(), 1);
}

TEST_F(CommRecoverTest, RevokeEndingInAnErrorFallsBackToAbort) {
  fake_.async_after_revoke = kNcclInternalError;
  auto m = ready(0, 3);
  FakeComm* parent = FakeNccl::of(m->handle());
  auto report = m->recover({.generation = 1, .excluded = {2}}, &store_);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_TRUE(report->fell_back_to_abort);
  EXPECT_TRUE(parent->aborted);
  EXPECT_EQ(fake_.shrinks, 0);
  EXPECT_EQ(report->plan.rebuild, Rebuild::kReinit);
}

TEST_F(CommRecoverTest, ShrinkDemandedButTooOld) {
  options_.rebuild_mode = RebuildMode::kShrink;
  fake_.version = nccl_version_code(2, 26, 5);
  auto m = ready(0, 2);
  auto report = m->recover({.generation = 1, .excluded = {1}}, &store_);
  EXPECT_EQ(report.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(report.status().message().find("2.27.0"), std::string::npos);
  EXPECT_EQ(m->state(), CommState::kReady);  // untouched
}

TEST_F(CommRecoverTest, JoinerForcesReinitAndJoinsThroughStore) {
  auto survivor = ready(0, 3);
  auto report = survivor->recover({.generation = 1, .excluded = {2}, .new_size = 3}, &store_);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->plan.rebuild, Rebuild::kReinit);
  // The spare takes the free rank of generation 1 through a fresh init.
  auto lib = NcclLibrary::from_table(fake_.table());
  CommManager spare(*lib, options_, &clock_, [this](Duration d) { clock_.advance(d); });
  ASSERT_TRUE(spare.init_from_store(store_, 1, 3, 2).ok());
  EXPECT_EQ(FakeNccl::of(spare.handle())->id, FakeNccl::of(survivor->handle())->id);
  EXPECT_EQ(spare.generation(), 1u);
}

TEST_F(CommRecoverTest, ShrinkChildArrivesAfterTheCallReturned) {
  // NCCL 2.28.9 returns ncclSuccess from a non-blocking ncclCommShrink with *newcomm still
  // null and writes the child from its own thread when the child's init completes.
  fake_.shrink_rc = kNcclSuccess;
  fake_.shrink_polls = 4;
  auto m = ready(0, 4);
  FakeComm* parent = FakeNccl::of(m->handle());
  fail(*m);
  auto report = m->recover({.generation = 1, .excluded = {3}}, nullptr);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  FakeComm* child = FakeNccl::of(m->handle());
  ASSERT_NE(child, parent);
  EXPECT_EQ(child->excluded, std::vector<int>{3});
  EXPECT_FALSE(child->aborted);
  EXPECT_TRUE(parent->destroyed);
  EXPECT_EQ(m->size(), 3);
  EXPECT_EQ(report->rebuild, 40ms);  // four polls of the parent until NCCL publishes it
  EXPECT_EQ(fake_.use_after_free, 0);
}

TEST_F(CommRecoverTest, CancelledWhileTheShrinkRunsAbortsParentAndChild) {
  fake_.shrink_polls = -1;
  auto lib = NcclLibrary::from_table(fake_.table());
  CommManager* self = nullptr;
  int sleeps = 0;
  // The sleeper stands in for the detector's thread: its verdict arrives during the wait.
  CommManager m(*lib, options_, &clock_, [&](Duration d) {
    clock_.advance(d);
    if (++sleeps == 3 && self != nullptr) self->request_abort();
  });
  ASSERT_TRUE(m.init(*m.new_unique_id(), 3, 1).ok());
  self = &m;
  sleeps = 0;
  FakeComm* parent = FakeNccl::of(m.handle());
  fail(m);
  auto report = m.recover({.generation = 1, .excluded = {0}}, nullptr);
  EXPECT_EQ(report.status().code(), StatusCode::kCancelled) << report.status().to_string();
  EXPECT_TRUE(parent->aborted);
  EXPECT_TRUE(fake_.comms.back()->aborted);  // the child whose init was still running
  EXPECT_EQ(m.state(), CommState::kAborted);
  EXPECT_EQ(m.handle(), nullptr);
  EXPECT_EQ(fake_.use_after_free, 0);
}

TEST_F(CommRecoverTest, SecondFailureDuringShrinkThenRetryWithReinit) {
  auto m = ready(0, 4);
  FakeComm* parent = FakeNccl::of(m->handle());
  fail(*m);
  fake_.shrink_async = kNcclRemoteError;  // rank 2 dies while we shrink away rank 3
  auto first = m->recover({.generation = 1, .excluded = {3}}, &store_);
  EXPECT_EQ(first.status().code(), StatusCode::kUnavailable) << first.status().to_string();
  EXPECT_NE(first.status().message().find("rebuilding generation 1"), std::string::npos);
  EXPECT_TRUE(fake_.comms.back()->aborted);  // the half-built child
  EXPECT_TRUE(parent->destroyed || parent->aborted);
  EXPECT_EQ(m->state(), CommState::kAborted);
  EXPECT_EQ(m->handle(), nullptr);
  EXPECT_EQ(m->size(), 4);  // ranks still refer to the failed communicator
  // Retrying the same generation is refused; a newer one rebuilds with a fresh init.
  EXPECT_EQ(m->recover({.generation = 1, .excluded = {2, 3}}, &store_).status().code(),
            StatusCode::kInvalidArgument);
  auto second = m->recover({.generation = 2, .excluded = {2, 3}}, &store_);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_EQ(second->plan, (RecoveryPlan{Teardown::kNone, Rebuild::kReinit}));
  EXPECT_EQ(m->size(), 2);
  EXPECT_EQ(m->generation(), 2u);
  EXPECT_EQ(fake_.use_after_free, 0);
}

TEST_F(CommRecoverTest, SecondFailureDuringShrinkAbortFailsFast) {
  fake_.version = nccl_version_code(2, 27, 3);  // shrink with NCCL_SHRINK_ABORT, no revoke
  fake_.shrink_polls = 3;
  fake_.shrink_async = kNcclRemoteError;  // the parent already reports this error too
  auto m = ready(0, 4);
  fail(*m);
  const TimePoint t0 = clock_.now();
  auto report = m->recover({.generation = 1, .excluded = {3}}, &store_);
  EXPECT_EQ(report.status().code(), StatusCode::kUnavailable) << report.status().to_string();
  EXPECT_LT(clock_.now() - t0, options_.init_timeout / 10);  // from the child, not a timeout
  EXPECT_EQ(m->state(), CommState::kAborted);
  EXPECT_EQ(fake_.use_after_free, 0);
}

TEST_F(CommRecoverTest, SecondFailureWhenShrinkNeverCompletes) {
  fake_.shrink_polls = -1;
  auto m = ready(1, 3);
  auto report = m->recover({.generation = 1, .excluded = {0}}, &store_);
  EXPECT_EQ(report.status().code(), StatusCode::kTimeout);
  EXPECT_EQ(m->state(), CommState::kAborted);
  EXPECT_EQ(m->rank(), 1);
}

TEST_F(CommRecoverTest, SecondFailureDuringReinitKeepsOldRanks) {
  options_.rebuild_mode = RebuildMode::kReinit;
  auto m = ready(2, 3);  // becomes rank 1 of 2: waits for new rank 0's id, which never comes
  auto report = m->recover({.generation = 1, .excluded = {0}}, &store_);
  EXPECT_EQ(report.status().code(), StatusCode::kTimeout);
  EXPECT_EQ(m->state(), CommState::kAborted);
  EXPECT_EQ(m->rank(), 2);
  EXPECT_EQ(m->size(), 3);
}

TEST_F(CommRecoverTest, RejectsBadRequests) {
  auto m = ready(1, 3);
  EXPECT_EQ(m->recover({.generation = 0, .excluded = {0}}, &store_).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(m->recover({.generation = 1, .excluded = {1}}, &store_).status().code(),
            StatusCode::kInvalidArgument);  // this rank itself
  EXPECT_EQ(m->recover({.generation = 1, .excluded = {7}}, &store_).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(m->state(), CommState::kReady);
  EXPECT_EQ(fake_.revokes + fake_.aborts, 0);
}

}  // namespace
}  // namespace resilient::comm
