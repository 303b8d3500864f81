#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "resilient/common/thread_pool.hpp"

namespace resilient {
namespace {

std::string current_thread_name() {
  char buf[16] = {};
  pthread_getname_np(pthread_self(), buf, sizeof(buf));
  return buf;
}

TEST(ThreadPool, SubmitReturnsResultsAndExceptions) {
  ThreadPool pool(2);
  auto a = pool.submit([] { return 40 + 2; });
  auto b = pool.submit([]() -> int { throw std::runtime_error("boom"); });
  EXPECT_EQ(a.get(), 42);
  EXPECT_THROW(b.get(), std::runtime_error);
}

TEST(ThreadPool, ParallelForVisitsEachIndexOnceAndRethrows) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> seen(1000);
  pool.parallel_for(seen.size(), [&](size_t i) { seen[i].fetch_add(1); });
  for (const auto& s : seen) EXPECT_EQ(s.load(), 1);
  EXPECT_THROW(pool.parallel_for(10,
                                 [](size_t i) {
                                   if (i == 7) throw std::invalid_argument("seven");
                                 }),
               std::invalid_argument);
}

TEST(ThreadPool, DestructorFinishesQueuedTasks) {
  std::atomic<int> done{0};
  {
    ThreadPool pool(1);
    for (int i = 0; i < 50; ++i) pool.submit([&] { done.fetch_add(1); });
  }
  EXPECT_EQ(done.load(), 50);
}

TEST(ThreadPool, WorkersCarryTheirName) {
  ThreadPool pool(2, ThreadSetup{"rs-ckpt-hash"});
  EXPECT_EQ(pool.submit(current_thread_name).get(), "rs-ckpt-hash");
  ThreadPool unnamed(1);
  EXPECT_EQ(unnamed.submit(current_thread_name).get(), "rs-pool");
}

TEST(ThreadPool, LongNamesAreTruncatedToTheKernelLimit) {
  ThreadPool pool(1, ThreadSetup{"resilient-checkpoint-writer"});
  EXPECT_EQ(pool.submit(current_thread_name).get(), "resilient-check");
}

std::vector<int> current_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

TEST(ThreadPool, WorkersRunOnTheGivenCpus) {
  const std::vector<int> all = current_cpus();
  ASSERT_FALSE(all.empty());
  ThreadPool pinned(2, ThreadSetup{"rs-pinned", 0, {all.back()}});
  EXPECT_EQ(pinned.submit(current_cpus).get(), std::vector<int>{all.back()});
  ThreadPool free(1);
  EXPECT_EQ(free.submit(current_cpus).get(), all);
}

TEST(ThreadPool, UnusableCpusLeaveTheWorkerUnpinned) {
  const std::vector<int> all = current_cpus();
  ThreadPool pool(1, ThreadSetup{"rs-nowhere", 0, {CPU_SETSIZE - 1}});  // not on this machine
  EXPECT_EQ(pool.submit(current_cpus).get(), all);
}

TEST(CpuList, ParsesRangesAndSingles) {
  EXPECT_EQ(*parse_cpu_list("8-11"), (std::vector<int>{8, 9, 10, 11}));
  EXPECT_EQ(*parse_cpu_list("0,2,4-5"), (std::vector<int>{0, 2, 4, 5}));
  EXPECT_TRUE(parse_cpu_list("")->empty());
}

TEST(CpuList, RejectsMalformedLists) {
  for (const char* bad : {"a", "3-1", "1,,2", "1,", "-2", "1-", "99999", "1.5", " 1"}) {
    auto r = parse_cpu_list(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("CPU list"), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace resilient
