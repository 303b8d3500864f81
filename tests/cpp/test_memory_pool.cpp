// HostPool: alignment, reuse, budget and timeouts, concurrency, reserve/trim, and pinning through
// a fake CUDA runtime.

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "memory/detail/cuda_table.hpp"
#include "resilient/memory/cuda.hpp"
#include "resilient/memory/pool.hpp"

namespace resilient::memory {
namespace {

using std::chrono::milliseconds;

PoolOptions opts(uint64_t slab, uint64_t budget, Feature pin = Feature::kOff) {
  PoolOptions o;
  o.slab_bytes = slab;
  o.budget_bytes = budget;
  o.pin = pin;
  return o;
}

TEST(HostPool, SlabsAreAlignedAndRoundedUp) {
  HostPool pool(opts(10000, 1 << 20));
  EXPECT_EQ(pool.slab_bytes(), 12288u);
  EXPECT_FALSE(pool.pinned());
  auto s = pool.acquire(milliseconds(100));
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(s->data()) % 4096, 0u);
  EXPECT_EQ(s->size(), 12288u);
  EXPECT_FALSE(s->pinned());
  s->data()[12287] = std::byte{1};  // whole slab is usable
  EXPECT_EQ(pool.in_use_bytes(), 12288u);
  s->release();
  EXPECT_FALSE(*s);
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  EXPECT_EQ(pool.allocated_bytes(), 12288u);
}

TEST(HostPool, ReleasedSlabsAreReused) {
  HostPool pool(opts(4096, 1 << 20));
  std::set<std::byte*> first;
  {
    std::vector<Slab> held;
    for (int i = 0; i < 5; ++i) {
      auto s = pool.acquire(milliseconds(100));
      ASSERT_TRUE(s.ok());
      first.insert(s->data());
      held.push_back(std::move(s).value());
    }
  }
  std::set<std::byte*> second;
  std::vector<Slab> held;
  for (int i = 0; i < 5; ++i) {
    auto s = pool.acquire(milliseconds(100));
    second.insert(s->data());
    held.push_back(std::move(s).value());
  }
  EXPECT_EQ(first, second);
  EXPECT_EQ(pool.allocated_bytes(), 5u * 4096);
  EXPECT_EQ(pool.slabs().size(), 5u);
}

TEST(HostPool, MoveTransfersOwnership) {
  HostPool pool(opts(4096, 8192));
  auto a = pool.acquire(milliseconds(10));
  Slab s1 = std::move(a).value();
  Slab s2 = std::move(s1);
  EXPECT_FALSE(s1);
  EXPECT_TRUE(s2);
  Slab s3;
  s3 = std::move(s2);
  EXPECT_EQ(pool.in_use_bytes(), 4096u);
  s3 = Slab();
  EXPECT_EQ(pool.in_use_bytes(), 0u);
}

TEST(HostPool, BudgetExhaustionTimesOut) {
  HostPool pool(opts(4096, 2 * 4096));
  auto a = pool.acquire(milliseconds(10));
  auto b = pool.acquire(milliseconds(10));
  ASSERT_TRUE(a.ok() && b.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto c = pool.acquire(milliseconds(50));
  EXPECT_EQ(c.status().code(), StatusCode::kTimeout);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(45));
  EXPECT_EQ(pool.allocated_bytes(), 2u * 4096);
}

TEST(HostPool, WaiterWakesOnRelease) {
  HostPool pool(opts(4096, 4096));
  auto a = pool.acquire(milliseconds(10));
  std::byte* addr = a->data();
  std::thread releaser([&] {
    std::this_thread::sleep_for(milliseconds(30));
    a->release();
  });
  auto b = pool.acquire(std::chrono::seconds(10));
  releaser.join();
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->data(), addr);
}

TEST(HostPool, BudgetSmallerThanOneSlab) {
  HostPool pool(opts(1 << 20, 4096));
  EXPECT_EQ(pool.acquire(milliseconds(10)).status().code(), StatusCode::kResourceExhausted);
}

TEST(HostPool, DefaultBudgetIsHalfOfPhysicalMemory) {
  HostPool pool(opts(4096, 0));
  uint64_t phys = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
  EXPECT_EQ(pool.budget_bytes(), phys / 2);
}

TEST(HostPool, ConcurrentAcquireReleaseStaysInBudget) {
  HostPool pool(opts(8192, 4 * 8192));
  std::atomic<int> held{0}, max_held{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto s = pool.acquire(std::chrono::seconds(10));
        if (!s.ok()) {
          ++failures;
          continue;
        }
        int now = ++held;
        int prev = max_held.load();
        while (now > prev && !max_held.compare_exchange_weak(prev, now)) {
        }
        s->data()[t] = std::byte(i);  // the slab is ours alone
        if (i % 16 == 0) std::this_thread::yield();
        --held;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(max_held.load(), 4);
  EXPECT_LE(pool.allocated_bytes(), 4u * 8192);
  EXPECT_EQ(pool.in_use_bytes(), 0u);
}

TEST(HostPool, ReserveAndTrim) {
  HostPool pool(opts(4096, 10 * 4096));
  uint64_t e0 = pool.epoch();
  ASSERT_TRUE(pool.reserve(3 * 4096 + 1).ok());
  EXPECT_EQ(pool.allocated_bytes(), 4u * 4096);
  EXPECT_GT(pool.epoch(), e0);
  ASSERT_TRUE(pool.reserve(1ull << 40).ok());  // bounded by the budget
  EXPECT_EQ(pool.allocated_bytes(), 10u * 4096);
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  auto held = pool.acquire(milliseconds(10));
  uint64_t e1 = pool.epoch();
  pool.trim();
  EXPECT_EQ(pool.allocated_bytes(), 4096u);
  EXPECT_GT(pool.epoch(), e1);
  EXPECT_EQ(pool.slabs().front().first, held->data());
}

// Pages of [p, p + n) in memory (mincore).
size_t resident_pages(const std::byte* p, uint64_t n) {
  std::vector<unsigned char> in(n / 4096);
  EXPECT_EQ(::mincore(const_cast<std::byte*>(p), n, in.data()), 0);
  return static_cast<size_t>(std::count_if(in.begin(), in.end(), [](auto v) { return v & 1; }));
}

// acquire() leaves a new slab's pages to its first writes (the threads that fill it fault them
// in parallel); reserve() faults them in ahead (a warm-up). 64 MiB slabs come from mmap, so their
// pages are new.
TEST(HostPool, AcquiredSlabsFaultAtFirstUseReservedOnesAhead) {
  const uint64_t slab = 64ull << 20;
  HostPool lazy(opts(slab, 2 * slab));
  auto s = lazy.acquire(milliseconds(100));
  ASSERT_TRUE(s.ok());
  EXPECT_LT(resident_pages(s->data(), slab), slab / 4096 / 2);
  std::memset(s->data(), 1, slab);  // usable as it is
  EXPECT_EQ(resident_pages(s->data(), slab), slab / 4096);

  HostPool warm(opts(slab, 2 * slab));
  ASSERT_TRUE(warm.reserve(slab).ok());
  auto r = warm.acquire(milliseconds(100));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(warm.allocated_bytes(), slab);  // the reserved slab, not a new one
  EXPECT_EQ(resident_pages(r->data(), slab), slab / 4096);
}

// --- pinning through a fake CUDA runtime --------------------------------------------------

std::atomic<int> g_allocs{0}, g_frees{0};
bool g_fail_alloc = false;

// The pool pins aligned memory with cudaHostRegister (cudaHostAlloc may return addresses that
// are not 4 KiB aligned, which O_DIRECT rejects); the fake checks the alignment it is given.
int fake_host_register(void* p, size_t n, unsigned) {
  if (g_fail_alloc) return detail::kCudaErrorMemoryAllocation;
  if (reinterpret_cast<uintptr_t>(p) % 4096 != 0 || n % 4096 != 0) return 1;
  ++g_allocs;
  return 0;
}
int fake_host_unregister(void*) {
  ++g_frees;
  return 0;
}
const char* fake_error_string(int) { return "fake error"; }

CudaRuntime::Table fake_table() {
  CudaRuntime::Table t;
  t.host_register = fake_host_register;
  t.host_unregister = fake_host_unregister;
  t.get_error_string = fake_error_string;
  return t;
}

TEST(HostPool, PinsThroughCudaWhenAvailable) {
  static const CudaRuntime::Table table = fake_table();
  CudaRuntime cuda(&table);
  g_allocs = g_frees = 0;
  {
    HostPool pool(opts(4096, 3 * 4096, Feature::kAuto), &cuda);
    EXPECT_TRUE(pool.pinned());
    ASSERT_TRUE(pool.reserve(2 * 4096).ok());
    auto s = pool.acquire(milliseconds(10));
    EXPECT_TRUE(s->pinned());
    EXPECT_EQ(g_allocs.load(), 2);
  }
  EXPECT_EQ(g_frees.load(), 2);
}

TEST(HostPool, PinningFailureIsAnError) {
  static const CudaRuntime::Table table = fake_table();
  CudaRuntime cuda(&table);
  g_fail_alloc = true;
  HostPool pool(opts(4096, 3 * 4096, Feature::kAuto), &cuda);
  auto s = pool.acquire(milliseconds(10));
  g_fail_alloc = false;
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.allocated_bytes(), 0u);
  EXPECT_TRUE(pool.acquire(milliseconds(10)).ok());  // the failed attempt left no hole
}

TEST(HostPool, PinOffOrNoCudaUsesPlainMemory) {
  static const CudaRuntime::Table table = fake_table();
  CudaRuntime cuda(&table);
  HostPool off(opts(4096, 4096, Feature::kOff), &cuda);
  EXPECT_FALSE(off.pinned());
  HostPool none(opts(4096, 4096, Feature::kAuto), nullptr);
  EXPECT_FALSE(none.pinned());
  EXPECT_TRUE(none.acquire(milliseconds(10)).ok());
  HostPool required(opts(4096, 4096, Feature::kOn), nullptr);
  EXPECT_EQ(required.acquire(milliseconds(10)).status().code(), StatusCode::kUnavailable);
}

TEST(PoolOptions, FromEnv) {
  ::setenv("RESILIENT_POOL_SLAB_BYTES", "1MiB", 1);
  ::setenv("RESILIENT_POOL_BYTES", "8MiB", 1);
  ::setenv("RESILIENT_PIN_MEMORY", "off", 1);
  PoolOptions o = PoolOptions::from_env().value();
  EXPECT_EQ(o.slab_bytes, 1u << 20);
  EXPECT_EQ(o.budget_bytes, 8u << 20);
  EXPECT_EQ(o.pin, Feature::kOff);
  ::unsetenv("RESILIENT_POOL_SLAB_BYTES");
  ::unsetenv("RESILIENT_POOL_BYTES");
  ::unsetenv("RESILIENT_PIN_MEMORY");
  EXPECT_EQ(PoolOptions::from_env().value().slab_bytes, 64u << 20);
  ::setenv("RESILIENT_POOL_SLAB_BYTES", "big", 1);
  auto bad = PoolOptions::from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("RESILIENT_POOL_SLAB_BYTES"), std::string::npos);
  ::setenv("RESILIENT_POOL_SLAB_BYTES", "0", 1);
  EXPECT_FALSE(PoolOptions::from_env().ok());
  ::unsetenv("RESILIENT_POOL_SLAB_BYTES");
}

}  // namespace
}  // namespace resilient::memory
