// CommManager against the fake NCCL table: init, collectives, timeouts and every recovery path.
#include <gtest/gtest.h>

#include "resilient/comm/comm_manager.hpp"
#include "test_comm_fake_nccl.hpp"

namespace resilient::comm {
namespace {

using testing::FakeComm;
using testing::FakeNccl;
using namespace std::chrono_literals;

class CommManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FakeNccl::current() = &fake_;
    options_.init_timeout = 5s;
    options_.collective_timeout = 2s;
    options_.quiesce_timeout = 1s;
    options_.store_timeout = 50ms;  // InMemoryStore waits in real time
    options_.poll_interval = 10ms;
  }
  void TearDown() override { FakeNccl::current() = nullptr; }

  std::unique_ptr<CommManager> make() {
    auto lib = NcclLibrary::from_table(fake_.table());
    EXPECT_TRUE(lib.ok()) << lib.status().to_string();
    return std::make_unique<CommManager>(*lib, options_, &clock_,
                                         [this](Duration d) { clock_.advance(d); });
  }
  // A ready manager at `rank` of `size` (fake init: no peers needed).
  std::unique_ptr<CommManager> ready(int rank, int size) {
    auto m = make();
    auto id = m->new_unique_id();
    EXPECT_TRUE(id.ok());
    Status st = m->init(*id, size, rank);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return m;
  }
  FakeComm* live(const CommManager& m) { return FakeNccl::of(m.handle()); }

  FakeNccl fake_;
  CommOptions options_;
  ManualClock clock_;
  InMemoryStore store_;
};

TEST_F(CommManagerTest, InitIsNonBlockingAndPolledUntilReady) {
  fake_.init_polls = 3;
  auto m = ready(1, 4);
  EXPECT_EQ(m->state(), CommState::kReady);
  EXPECT_EQ(fake_.last_blocking, 0);
  EXPECT_EQ(fake_.last_config_version, static_cast<unsigned>(fake_.version));
  EXPECT_EQ(fake_.polls, 4);  // three in progress, one ready
  EXPECT_EQ(clock_.now() - TimePoint{}, 30ms);
  EXPECT_EQ(m->rank(), 1);
  EXPECT_EQ(m->size(), 4);
  EXPECT_EQ(fake_.use_after_free, 0);
}

TEST_F(CommManagerTest, InitThatNeverCompletesTimesOutAndAborts) {
  fake_.init_polls = -1;
  auto m = make();
  Status st = m->init(*m->new_unique_id(), 4, 0);
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_EQ(fake_.aborts, 1);
  EXPECT_TRUE(fake_.comms.back()->aborted);
  EXPECT_EQ(m->state(), CommState::kEmpty);
  EXPECT_EQ(m->handle(), nullptr);
  EXPECT_GE(clock_.now() - TimePoint{}, options_.init_timeout);
  EXPECT_LT(clock_.now() - TimePoint{}, options_.init_timeout + 2 * options_.poll_interval);
  // A later init with a fresh id works.
  fake_.init_polls = 0;
  EXPECT_TRUE(m->init(*m->new_unique_id(), 4, 0, 1).ok());
}

TEST_F(CommManagerTest, InitErrorIsReportedAndAborted) {
  auto m = make();
  NcclUniqueId id = *m->new_unique_id();
  fake_.init_rc = kNcclSystemError;
  Status st = m->init(id, 2, 1);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  EXPECT_NE(st.message().find("fake last error"), std::string::npos);
  EXPECT_TRUE(fake_.comms.back()->aborted);
  EXPECT_EQ(m->state(), CommState::kEmpty);
}

TEST_F(CommManagerTest, InitFromStoreSharesRankZeroId) {
  auto m0 = make();
  auto m1 = make();
  ASSERT_TRUE(m0->init_from_store(store_, 0, 2, 0).ok());
  ASSERT_TRUE(m1->init_from_store(store_, 0, 2, 1).ok());
  EXPECT_EQ(live(*m0)->id, "fake-id-1");
  EXPECT_EQ(live(*m1)->id, "fake-id-1");
  EXPECT_EQ(fake_.unique_ids, 1);
}

TEST_F(CommManagerTest, InitFromStoreTimesOutWithoutRankZero) {
  auto m = make();
  Status st = m->init_from_store(store_, 0, 2, 1);
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_EQ(fake_.inits, 0);
}

TEST_F(CommManagerTest, InitFromStoreRejectsMalformedId) {
  ASSERT_TRUE(store_.set("resilient/comm/default/gen0/nccl_id", "short", 1s).ok());
  auto m = make();
  EXPECT_EQ(m->init_from_store(store_, 0, 2, 1).code(), StatusCode::kCorrupt);
}

TEST_F(CommManagerTest, AllReduceAndWaitUntilDone) {
  auto m = ready(0, 2);
  ASSERT_TRUE(
      m->all_reduce(nullptr, nullptr, 4, NcclDataType::kFloat32, NcclRedOp::kSum, nullptr).ok());
  int queries = 0;
  Status st = m->wait([&]() -> Result<bool> { return ++queries == 3; }, 1s);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(queries, 3);
  EXPECT_EQ(fake_.all_reduces, 1);
}

TEST_F(CommManagerTest, CollectiveThatNeverCompletesTimesOut) {
  auto m = ready(0, 2);
  ASSERT_TRUE(
      m->all_reduce(nullptr, nullptr, 4, NcclDataType::kFloat32, NcclRedOp::kSum, nullptr).ok());
  const TimePoint before = clock_.now();
  Status st = m->wait([]() -> Result<bool> { return false; }, 500ms);
  EXPECT_EQ(st.code(), StatusCode::kTimeout);
  EXPECT_GE(clock_.now() - before, 500ms);
  EXPECT_EQ(m->state(), CommState::kFailed);
  // A failed communicator refuses new collectives until recovered.
  EXPECT_EQ(
      m->all_reduce(nullptr, nullptr, 1, NcclDataType::kFloat32, NcclRedOp::kSum, nullptr).code(),
      StatusCode::kFailedPrecondition);
}

TEST_F(CommManagerTest, EnqueueErrorFailsTheCommunicator) {
  auto m = ready(0, 2);
  fake_.collective_rc = kNcclRemoteError;
  Status st = m->broadcast(nullptr, nullptr, 1, NcclDataType::kUint8, 0, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_EQ(m->state(), CommState::kFailed);
}

TEST_F(CommManagerTest, RequestAbortCancelsAWait) {
  auto m = ready(0, 2);
  Status st = m->wait(
      [&]() -> Result<bool> {
        m->request_abort();  // as a detector thread would
        return false;
      },
      10s);
  EXPECT_EQ(st.code(), StatusCode::kCancelled);
  EXPECT_EQ(m->state(), CommState::kFailed);
}

TEST_F(CommManagerTest, CheckReportsAsyncError) {
  auto m = ready(0, 2);
  EXPECT_TRUE(m->check().ok());
  live(*m)->async = kNcclRemoteError;
  EXPECT_EQ(m->check().code(), StatusCode::kUnavailable);
  EXPECT_EQ(m->state(), CommState::kFailed);
}

TEST_F(CommManagerTest, AbortIsIdempotentAndDestructorAbortsLiveComm) {
  auto m = ready(0, 2);
  FakeComm* c = live(*m);
  EXPECT_TRUE(m->abort().ok());
  EXPECT_TRUE(m->abort().ok());
  EXPECT_TRUE(c->aborted);
  EXPECT_EQ(fake_.aborts, 1);
  EXPECT_EQ(m->state(), CommState::kAborted);
  auto m2 = ready(0, 2);
  FakeComm* c2 = live(*m2);
  m2.reset();
  EXPECT_TRUE(c2->aborted);
}

}  // namespace
}  // namespace resilient::comm
