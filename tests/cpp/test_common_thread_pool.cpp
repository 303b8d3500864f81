#include <gtest/gtest.h>
#include <pthread.h>

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
  EXPECT_THROW(pool.parallel_for(10, [](size_t i) {
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
  ThreadPool pool(2, 0, "rs-ckpt-hash");
  EXPECT_EQ(pool.submit(current_thread_name).get(), "rs-ckpt-hash");
  ThreadPool unnamed(1);
  EXPECT_EQ(unnamed.submit(current_thread_name).get(), "rs-pool");
}

TEST(ThreadPool, LongNamesAreTruncatedToTheKernelLimit) {
  ThreadPool pool(1, 0, "resilient-checkpoint-writer");
  EXPECT_EQ(pool.submit(current_thread_name).get(), "resilient-check");
}

}  // namespace
}  // namespace resilient
