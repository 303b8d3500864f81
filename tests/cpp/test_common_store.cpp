// The Store contract (common/store.hpp) as InMemoryStore keeps it: absent keys, waiting gets,
// compare-and-set on absent and present keys, an unavailable store.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "resilient/common/store.hpp"

namespace resilient {
namespace {
using namespace std::chrono_literals;

TEST(InMemoryStore, AbsentKeyIsNotFoundAtOnceOrWaitedFor) {
  InMemoryStore store;
  EXPECT_EQ(store.get("k", 1s, IfAbsent::kFail).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store.get("k", 10ms, IfAbsent::kWait).status().code(), StatusCode::kTimeout);
  std::thread setter([&] {
    std::this_thread::sleep_for(20ms);
    EXPECT_TRUE(store.set("k", std::string("a\0b", 3), 1s).ok());
  });
  auto v = store.get("k", 5s, IfAbsent::kWait);
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, std::string("a\0b", 3));
  EXPECT_EQ(*store.get("k", 0s, IfAbsent::kFail), std::string("a\0b", 3));
  EXPECT_TRUE(store.set("k", "c", 1s).ok());  // overwrites
  EXPECT_EQ(*store.get("k", 0s, IfAbsent::kWait), "c");
  EXPECT_EQ(store.size(), 1u);
}

TEST(InMemoryStore, CompareSetFirstWriterWins) {
  InMemoryStore store;
  EXPECT_EQ(*store.compare_set("k", "", "a", 1s), "a");
  EXPECT_EQ(*store.compare_set("k", "", "b", 1s), "a");   // the loser gets the winner's value
  EXPECT_EQ(*store.compare_set("k", "x", "b", 1s), "a");  // a mismatch changes nothing
  EXPECT_EQ(*store.compare_set("k", "a", "b", 1s), "b");
  EXPECT_EQ(*store.get("k", 1s, IfAbsent::kFail), "b");
}

TEST(InMemoryStore, CompareSetOnAnAbsentKeyWithAnExpectedValueIsNotFound) {
  InMemoryStore store;
  EXPECT_EQ(store.compare_set("k", "a", "b", 1s).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store.get("k", 1s, IfAbsent::kFail).status().code(), StatusCode::kNotFound);
}

TEST(InMemoryStore, CompareSetWakesAWaitingGet) {
  InMemoryStore store;
  std::thread writer([&] {
    std::this_thread::sleep_for(20ms);
    EXPECT_TRUE(store.compare_set("k", "", "v", 1s).ok());
  });
  auto v = store.get("k", 5s, IfAbsent::kWait);
  writer.join();
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, "v");
}

TEST(InMemoryStore, UnavailableFailsEveryCallAndAWaitingGet) {
  InMemoryStore store;
  ASSERT_TRUE(store.set("k", "v", 1s).ok());
  std::thread outage([&] {
    std::this_thread::sleep_for(20ms);
    store.set_unavailable(true);
  });
  auto waiting = store.get("absent", 5s, IfAbsent::kWait);
  outage.join();
  EXPECT_EQ(waiting.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(store.set("k", "w", 1s).code(), StatusCode::kUnavailable);
  EXPECT_EQ(store.get("k", 1s, IfAbsent::kFail).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(store.compare_set("k", "v", "w", 1s).status().code(), StatusCode::kUnavailable);
  store.set_unavailable(false);
  EXPECT_EQ(*store.get("k", 1s, IfAbsent::kFail), "v");
  EXPECT_EQ(store.calls(), 6u);
}

}  // namespace
}  // namespace resilient
