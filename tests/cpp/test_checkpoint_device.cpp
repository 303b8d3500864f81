// The CUDA paths of the engine (device-to-host snapshot, host-to-device restore) against a fake
// CUDA runtime whose "device memory" is host memory and whose copies run late: a copy only
// happens when an event recorded after it is first polled twice. Reading a slab before its copy
// event completed would therefore save stale bytes, and these tests would see them. As in CUDA,
// each thread has a current device, streams and events belong to the device current when they
// were created, and recording an event on another device's stream fails (error 400).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <utility>
#include <vector>

#include "io_test_util.hpp"
#include "memory/detail/cuda_table.hpp"
#include "resilient/checkpoint/checkpointer.hpp"
#include "resilient/checkpoint/commit.hpp"

namespace resilient::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using memory::CudaRuntime;

struct FakeGpu {
  struct Op {
    void* dst;
    const void* src;
    size_t n;
  };
  std::mutex mu;
  std::map<void*, std::vector<Op>> queued;           // per stream, not yet executed
  std::map<void*, std::pair<void*, size_t>> events;  // event -> (stream, ops queued before it)
  std::map<void*, int> polls;
  std::map<void*, int> owner;      // stream or event -> its device
  std::map<void*, int> destroyed;  // event -> times destroyed
  int fail_record_at = 0;          // > 0: that many event records later, one fails
  bool hung = false;               // copies never complete (a hung GPU) until cleared
  std::vector<int> h2d, d2h;
  // When non-empty: the "cudaMalloc" allocations; a device-to-host copy must lie inside one.
  std::vector<std::pair<const std::byte*, size_t>> allocations;
  uintptr_t next = 0x1000;

  static FakeGpu& get() {
    static FakeGpu g;
    return g;
  }
  void* handle() { return reinterpret_cast<void*>(next += 16); }
  static int& current() {
    thread_local int device = 0;
    return device;
  }
  void flush(void* stream, size_t upto) {
    auto& q = queued[stream];
    upto = std::min(upto, q.size());
    for (size_t i = 0; i < upto; ++i) std::memcpy(q[i].dst, q[i].src, q[i].n);
    q.erase(q.begin(), q.begin() + static_cast<long>(upto));
    for (auto& [e, rec] : events) {
      if (rec.first == stream) rec.second = rec.second > upto ? rec.second - upto : 0;
    }
  }
};

int ok() { return 0; }

int fake_copy(void* dst, const void* src, size_t n, int kind, void* stream) {
  auto& g = FakeGpu::get();
  std::lock_guard<std::mutex> lock(g.mu);
  if (kind == 2 && !g.allocations.empty()) {
    auto* p = static_cast<const std::byte*>(src);
    bool inside = false;
    for (auto [base, len] : g.allocations) inside |= p >= base && p + n <= base + len;
    if (!inside) return 1;  // cudaErrorInvalidValue, as the real runtime answers
  }
  g.queued[stream].push_back({dst, src, n});
  (kind == 1 ? g.h2d : g.d2h).push_back(static_cast<int>(n));
  return ok();
}

// cudaMemcpyBatchAsync: the direction comes from the pointers (here: device-to-host, the only
// batched direction); it fails as a whole with `batch_error` when that is set.
std::atomic<int> batch_error{0};
std::atomic<int> batch_calls{0};
thread_local int last_error = 0;  // cudaGetLastError's, per thread as in CUDA
int fake_batch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
               void* attrs, size_t* attrs_idx, size_t nattrs, void* stream) {
  if (batch_error != 0) return last_error = batch_error;
  auto* a = static_cast<memory::detail::MemcpyAttributes*>(attrs);
  if (nattrs != 1 || attrs_idx[0] != 0 || a->src_access_order != 1 || stream == nullptr) return 1;
  ++batch_calls;
  for (size_t i = 0; i < count; ++i) {
    int err = fake_copy(dsts[i], srcs[i], sizes[i], 2, stream);
    if (err != 0) return err;
  }
  return ok();
}

const CudaRuntime::Table* fake_table() {
  static CudaRuntime::Table t = [] {
    CudaRuntime::Table t;
    t.get_device_count = [](int* n) {
      *n = 2;
      return ok();
    };
    t.set_device = [](int d) {
      if (d < 0 || d >= 2) return 101;  // cudaErrorInvalidDevice
      FakeGpu::current() = d;
      return ok();
    };
    t.get_device = [](int* d) {
      *d = FakeGpu::current();
      return ok();
    };
    t.memcpy_async = fake_copy;
    t.memcpy_batch_async = fake_batch;
    t.get_last_error = [] { return std::exchange(last_error, 0); };
    t.stream_create_with_flags = [](void** s, unsigned) {
      auto& g = FakeGpu::get();
      std::lock_guard<std::mutex> lock(g.mu);
      *s = g.handle();
      g.owner[*s] = FakeGpu::current();
      return ok();
    };
    t.stream_destroy = [](void*) { return ok(); };
    t.event_create_with_flags = [](void** e, unsigned) {
      auto& g = FakeGpu::get();
      std::lock_guard<std::mutex> lock(g.mu);
      *e = g.handle();
      g.owner[*e] = FakeGpu::current();
      return ok();
    };
    t.event_destroy = [](void* e) {
      auto& g = FakeGpu::get();
      std::lock_guard<std::mutex> lock(g.mu);
      ++g.destroyed[e];
      return ok();
    };
    t.event_record = [](void* e, void* stream) {
      auto& g = FakeGpu::get();
      std::lock_guard<std::mutex> lock(g.mu);
      if (g.fail_record_at > 0 && --g.fail_record_at == 0) return 999;  // cudaErrorUnknown
      // Stream 0 is the current device's default stream; other streams not made here (the
      // tests' producer streams) are not checked.
      auto so = g.owner.find(stream);
      if (stream != nullptr && so != g.owner.end() && so->second != g.owner[e]) {
        return 400;  // cudaErrorInvalidResourceHandle
      }
      g.events[e] = {stream, g.queued[stream].size()};
      return ok();
    };
    t.stream_wait_event = [](void*, void*, unsigned) { return ok(); };
    t.event_query = [](void* e) {
      auto& g = FakeGpu::get();
      std::lock_guard<std::mutex> lock(g.mu);
      auto it = g.events.find(e);
      if (it == g.events.end()) return ok();
      if (g.hung) return 600;
      if (it->second.second == 0) return ok();  // its copies already ran
      if (++g.polls[e] < 2) return 600;         // cudaErrorNotReady: the copy is still "running"
      g.flush(it->second.first, it->second.second);
      return ok();
    };
    t.stream_synchronize = [](void* s) {
      auto& g = FakeGpu::get();
      std::lock_guard<std::mutex> lock(g.mu);
      g.flush(s, SIZE_MAX);
      return ok();
    };
    t.get_error_string = [](int) { return "fake"; };
    return t;
  }();
  return &t;
}

class DeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("resilient-dev-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::unique_ptr<Checkpointer> make(const CudaRuntime* cuda, int zstd = 0, Duration timeout = 30s,
                                     uint64_t group_bytes = 1 << 30) {
    auto o = CheckpointOptions::from_env(root_.string()).value();
    o.copy_group_bytes = group_bytes;
    o.zstd_level = zstd;
    o.chunk_bytes = 64 << 10;
    o.pool.slab_bytes = 256 << 10;
    o.pool.budget_bytes = 64 << 20;
    o.pool.pin = Feature::kOff;
    o.timeout = timeout;
    o.cuda = cuda;
    auto c = Checkpointer::create(o);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return std::move(c).value();
  }
  fs::path root_;
};

TEST_F(DeviceTest, DeviceTensorsRoundTripInBothModes) {
  CudaRuntime cuda(fake_table());
  for (SaveMode mode : {SaveMode::kBlocking, SaveMode::kOverlap}) {
    for (int zstd : {0, 3}) {
      fs::remove_all(root_);
      auto c = make(&cuda, zstd);
      std::vector<float> gpu0(200'000), gpu1(3000);  // "device memory" on devices 0 and 1
      std::vector<int32_t> host(100);
      std::iota(gpu0.begin(), gpu0.end(), 1.0f);
      std::iota(gpu1.begin(), gpu1.end(), -5.0f);
      std::iota(host.begin(), host.end(), 7);
      auto expect0 = gpu0, expect1 = gpu1;
      std::vector<TensorSpec> specs = {
          {"a", "float32", {200'000}, gpu0.data(), gpu0.size() * 4, 0, 0x77},
          {"h", "int32", {100}, host.data(), 400},
          {"b", "float32", {3000}, gpu1.data(), gpu1.size() * 4, 1, 0}};
      FakeGpu::current() = 1;  // the caller's current device, which the engine must keep
      auto h = c->save(1, specs, {}, true, mode);
      EXPECT_EQ(FakeGpu::current(), 1);
      ASSERT_TRUE(h.ok()) << h.status().to_string();
      ASSERT_TRUE((*h)->wait_snapshot(10s).ok());
      std::fill(gpu0.begin(), gpu0.end(), 0.0f);  // the tensors change after the fence
      std::fill(gpu1.begin(), gpu1.end(), 0.0f);
      ASSERT_TRUE((*h)->wait(30s).ok());

      std::vector<float> back0(gpu0.size()), back1(gpu1.size());
      std::vector<int32_t> hback(100);
      auto m = c->manifest(1);
      ASSERT_TRUE(m.ok());
      std::vector<ReadTarget> targets = {{"a", back0.data(), back0.size() * 4, 0},
                                         {"h", hback.data(), 400, -1},
                                         {"b", back1.data(), back1.size() * 4, 1}};
      FakeGpu::current() = 0;
      Status read = c->read(*m, targets);
      ASSERT_TRUE(read.ok()) << read.to_string();
      EXPECT_EQ(FakeGpu::current(), 0);
      FakeGpu::current() = 1;
      c.reset();  // destroys the per-device copy streams, on this thread
      EXPECT_EQ(FakeGpu::current(), 1);
      EXPECT_EQ(back0, expect0) << "zstd=" << zstd;
      EXPECT_EQ(back1, expect1);
      EXPECT_EQ(hback, host);
    }
  }
  EXPECT_FALSE(FakeGpu::get().d2h.empty());
  EXPECT_FALSE(FakeGpu::get().h2d.empty());
}

// Saves a large tensor on device 0 (slabs 0-3 of 256 KiB, in 13 chunks of 64 KiB merged into a
// copy per slab) and 20 small ones on device 1 (all in slab 3), then reads them back: the bytes
// must survive whichever way the copies were queued. 24 device-to-host copies.
void expect_round_trip(std::unique_ptr<Checkpointer> c) {
  std::vector<float> big(200'000);
  std::iota(big.begin(), big.end(), 1.0f);
  std::vector<std::vector<float>> small(20, std::vector<float>(1000));
  std::vector<TensorSpec> specs = {
      {"a", "float32", {200'000}, big.data(), big.size() * 4, 0, 0x77}};
  for (size_t i = 0; i < small.size(); ++i) {
    std::iota(small[i].begin(), small[i].end(), -5.0f * static_cast<float>(i));
    specs.push_back({"s" + std::to_string(i), "float32", {1000}, small[i].data(), 4000, 1, 0});
  }
  auto h = c->save(1, specs, {}, true, SaveMode::kOverlap);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE((*h)->wait(30s).ok());
  auto m = c->manifest(1);
  ASSERT_TRUE(m.ok());
  std::vector<float> back(big.size());
  std::vector<std::vector<float>> small_back(small.size(), std::vector<float>(1000));
  std::vector<ReadTarget> targets = {{"a", back.data(), back.size() * 4, -1}};
  for (size_t i = 0; i < small.size(); ++i) {
    targets.push_back({"s" + std::to_string(i), small_back[i].data(), 4000, -1});
  }
  ASSERT_TRUE(c->read(*m, targets).ok());
  EXPECT_EQ(back, big);
  EXPECT_EQ(small_back, small);
}

// One cudaMemcpyBatchAsync per (group of slabs, device) of more than one copy: here all slabs
// are one group, so the large tensor's four copies (one per slab: never merged across slabs) on
// device 0 and the 20 small tensors of slab 3 on device 1 make two batches. With groups of one
// slab, the large tensor's copies go one by one and only slab 3's small ones are batched.
TEST_F(DeviceTest, SlabCopiesAreQueuedAsOneBatchPerGroupAndDevice) {
  CudaRuntime cuda(fake_table());
  batch_calls = 0;
  FakeGpu::get().d2h.clear();
  expect_round_trip(make(&cuda));
  EXPECT_EQ(batch_calls, 2);
  EXPECT_EQ(FakeGpu::get().d2h.size(), 24u);
  EXPECT_TRUE(cuda.batches_copies());
  fs::remove_all(root_);
  batch_calls = 0;
  FakeGpu::get().d2h.clear();
  expect_round_trip(make(&cuda, 0, 30s, 256 << 10));
  EXPECT_EQ(batch_calls, 1);
  EXPECT_EQ(FakeGpu::get().d2h.size(), 24u);
}

// The event closing a group of copies cannot be recorded (after the producer's, the second
// record fails): the save fails, and the group's copies, queued with nothing to wait on, have
// run (the stream was synchronized) before its slabs went back to the pool.
TEST_F(DeviceTest, AGroupWhoseEventFailsIsWaitedForBeforeItsSlabsReturn) {
  CudaRuntime cuda(fake_table());
  auto& g = FakeGpu::get();
  std::vector<float> data(3 * 65536, 2.5f);  // three 256 KiB slabs, one group
  std::vector<TensorSpec> specs = {
      {"a", "float32", {static_cast<int64_t>(data.size())}, data.data(), data.size() * 4, 0, 0}};
  auto c = make(&cuda);
  {
    std::lock_guard<std::mutex> lock(g.mu);
    g.fail_record_at = 2;
  }
  auto h = c->save(1, specs, {}, true, SaveMode::kOverlap);
  {
    std::lock_guard<std::mutex> lock(g.mu);
    g.fail_record_at = 0;
    EXPECT_FALSE(h.ok());
    for (auto& [stream, ops] : g.queued) EXPECT_TRUE(ops.empty()) << "a copy still pending";
  }
  EXPECT_EQ(c->pool().in_use_bytes(), 0u);
  auto again = c->save(2, specs, {}, true, SaveMode::kOverlap);  // and the next save works
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  ASSERT_TRUE((*again)->wait(30s).ok());
}

// Groups of two slabs over a tensor of seven: four groups, each closed by one event that is the
// event of each of its slabs, on copy streams taken in turn; a slab is complete only when its
// group's event is, and every event is destroyed exactly once.
TEST_F(DeviceTest, ConsecutiveSlabsShareOneEventPerGroup) {
  CudaRuntime cuda(fake_table());
  auto& g = FakeGpu::get();
  std::vector<float> data(7 * 65536 - 100);  // seven 256 KiB slabs, the last one partly
  std::iota(data.begin(), data.end(), 3.0f);
  std::vector<TensorSpec> specs = {
      {"a", "float32", {static_cast<int64_t>(data.size())}, data.data(), data.size() * 4, 0, 0}};
  std::vector<memory::EventHandle> events;
  {
    auto c = make(&cuda, 0, 30s, 512 << 10);
    Staging st;
    {
      ThreadPool pool(1);
      DeviceStreams streams(&cuda, 4);
      auto s = snapshot(specs, c->pool(), pool, 64 << 10, 30s, &streams, 512 << 10);
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      st = std::move(s).value();
      ASSERT_EQ(st.slabs.size(), 7u);
      const auto& copies = *st.copies;
      ASSERT_EQ(copies.events.size(), 4u);
      for (size_t i = 0; i < 7; ++i) {
        ASSERT_EQ(copies.slab_events[i].size(), 1u);
        EXPECT_EQ(copies.slab_events[i][0], copies.events[i / 2]) << "slab " << i;
      }
      std::set<void*> used;
      {
        std::lock_guard<std::mutex> lock(g.mu);
        for (auto e : copies.events) used.insert(g.events[reinterpret_cast<void*>(e)].first);
      }
      EXPECT_EQ(used.size(), 4u) << "each group on its own copy stream";
      EXPECT_FALSE(copies.slab_done(0));  // first poll: the fake copy is still "running"
      ASSERT_TRUE(copies.wait_slab(1, 10s).ok());
      EXPECT_TRUE(copies.slab_done(0)) << "slab 0 completes with its group's event";
      ASSERT_TRUE(copies.wait_all(10s).ok());
      std::vector<float> back(data.size());
      for (size_t i = 0; i < 7; ++i) {
        const size_t n = std::min<size_t>(65536, data.size() - i * 65536);
        std::memcpy(back.data() + i * 65536, st.slabs[i].data(), n * 4);
      }
      EXPECT_EQ(back, data);
      events = copies.events;
      st.release_slabs();
      st.copies.reset();
    }
  }
  std::lock_guard<std::mutex> lock(g.mu);
  for (auto e : events)
    EXPECT_EQ(g.destroyed[reinterpret_cast<void*>(e)], 1) << "an event destroyed more than once";
}

// A runtime that refuses the batch (an old driver): the copies go one by one, from then on.
TEST_F(DeviceTest, AFailedBatchFallsBackToSingleCopies) {
  CudaRuntime cuda(fake_table());
  batch_error = 801;  // cudaErrorNotSupported
  batch_calls = 0;
  FakeGpu::get().d2h.clear();
  expect_round_trip(make(&cuda));
  batch_error = 0;
  EXPECT_EQ(last_error, 0) << "the refusal must not stay the thread's last CUDA error";
  EXPECT_EQ(batch_calls, 0);
  EXPECT_EQ(FakeGpu::get().d2h.size(), 24u);
  EXPECT_FALSE(cuda.batches_copies());
  fs::remove_all(root_);
  expect_round_trip(make(&cuda));  // batching stays off
  EXPECT_EQ(batch_calls, 0);
}

// A runtime without the batch call (CUDA 12, RESILIENT_COPY_BATCH=0).
TEST_F(DeviceTest, WithoutTheBatchCallCopiesGoOneByOne) {
  static CudaRuntime::Table table = *fake_table();
  table.memcpy_batch_async = nullptr;
  CudaRuntime cuda(&table);
  batch_calls = 0;
  FakeGpu::get().d2h.clear();
  expect_round_trip(make(&cuda));
  EXPECT_EQ(batch_calls, 0);
  EXPECT_EQ(FakeGpu::get().d2h.size(), 24u);
  EXPECT_FALSE(cuda.batches_copies());
}

// Two tensors whose allocations happen to be adjacent in address space (as the caching allocator
// can place them) and whose slab placements are adjacent too must still be copied separately.
TEST_F(DeviceTest, AdjacentAllocationsAreNotCopiedAsOne) {
  CudaRuntime cuda(fake_table());
  auto c = make(&cuda);
  std::vector<float> block(2 * 4096);
  std::iota(block.begin(), block.end(), 0.0f);
  auto& g = FakeGpu::get();
  {
    std::lock_guard<std::mutex> lock(g.mu);
    g.allocations = {{reinterpret_cast<const std::byte*>(block.data()), 4096 * 4},
                     {reinterpret_cast<const std::byte*>(block.data() + 4096), 4096 * 4}};
  }
  std::vector<TensorSpec> specs = {{"a", "float32", {4096}, block.data(), 4096 * 4, 0, 0},
                                   {"b", "float32", {4096}, block.data() + 4096, 4096 * 4, 0, 0}};
  auto h = c->save(1, specs, {});
  {
    std::lock_guard<std::mutex> lock(g.mu);
    g.allocations.clear();
  }
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE((*h)->wait(30s).ok());
  std::vector<float> back(2 * 4096);
  auto m = c->manifest(1);
  std::vector<ReadTarget> t = {{"a", back.data(), 4096 * 4, -1},
                               {"b", back.data() + 4096, 4096 * 4, -1}};
  ASSERT_TRUE(c->read(*m, t).ok());
  EXPECT_EQ(back, block);
}

// Restore to a device in groups of extents (two per read, two threads, and slabs smaller than
// the chunks): a slab is read into again only after the late copies out of it ran. And a corrupt
// chunk in the second extent of a group fails the restore with no copy left running out of
// slabs that go back to the pool.
TEST_F(DeviceTest, GroupedRestoreToADeviceWaitsForItsCopies) {
  CudaRuntime cuda(fake_table());
  for (int zstd : {0, 3}) {
    fs::remove_all(root_);
    auto c = make(&cuda, zstd);
    std::vector<float> gpu(200'000);
    std::iota(gpu.begin(), gpu.end(), 3.0f);
    std::vector<TensorSpec> specs = {{"a", "float32", {200'000}, gpu.data(), gpu.size() * 4, 0, 0}};
    auto h = c->save(1, specs, {});
    ASSERT_TRUE(h.ok() && (*h)->wait(30s).ok());
    auto read = [&](uint64_t slab, std::vector<float>& back) {
      auto o = CheckpointOptions::from_env(root_.string()).value();
      o.chunk_bytes = slab;
      o.pool.slab_bytes = slab;
      o.pool.budget_bytes = 64 << 20;
      o.pool.pin = Feature::kOff;
      o.io.request_bytes = slab;
      o.io.queue_depth = 2;  // two extents per read
      o.restore_threads = 2;
      o.timeout = 10s;
      o.cuda = &cuda;
      auto reader = Checkpointer::create(o);
      EXPECT_TRUE(reader.ok());
      auto m = (*reader)->manifest(1);
      EXPECT_TRUE(m.ok());
      back.assign(gpu.size(), 0.0f);
      std::vector<ReadTarget> t = {{"a", back.data(), back.size() * 4, 0}};
      return (*reader)->read(*m, t);
    };
    for (uint64_t slab : {64u << 10, 16u << 10}) {  // 16 KiB: the 64 KiB chunks go to heap buffers
      std::vector<float> back;
      Status s = read(slab, back);
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_EQ(back, gpu) << "zstd " << zstd << " slab " << slab;
    }
    // Corrupt the second 64 KiB extent: the first group's first extent was already copied.
    io::testing::flip_byte((root_ / step_dir_name(1) / shard_file_name(0)).string(), 70'000);
    std::vector<float> back;
    EXPECT_EQ(read(64 << 10, back).code(), StatusCode::kCorrupt);
    auto& g = FakeGpu::get();
    std::lock_guard<std::mutex> lock(g.mu);
    for (const auto& [stream, ops] : g.queued)
      EXPECT_TRUE(ops.empty()) << "a copy was left running";
  }
}

TEST_F(DeviceTest, DeviceTensorsWithoutCudaAreUnavailable) {
  auto o = CheckpointOptions::from_env(root_.string()).value();
  o.pool.budget_bytes = 64 << 20;
  o.pool.pin = Feature::kOff;
  auto c = Checkpointer::create(o);
  ASSERT_TRUE(c.ok());
  if (CudaRuntime::get() != nullptr) GTEST_SKIP() << "a real GPU is present";
  std::vector<float> x(10);
  std::vector<TensorSpec> specs = {{"a", "float32", {10}, x.data(), 40, 0, 0}};
  auto h = (*c)->save(1, specs, {});
  EXPECT_EQ(h.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(h.status().message().find("CUDA"), std::string::npos);
}

// A device-to-host copy that times out may still land later: its slabs stay out of the pool
// (quarantined) until its event completes, so no later checkpoint is written from a slab that a
// late copy overwrites; the first save after the copies completed returns them.
TEST_F(DeviceTest, SlabsOfTimedOutCopiesAreQuarantinedNotReused) {
  CudaRuntime cuda(fake_table());
  auto& gpu = FakeGpu::get();
  for (SaveMode mode : {SaveMode::kOverlap, SaveMode::kBlocking}) {
    fs::remove_all(root_);
    auto c = make(&cuda, 0, 1s);
    const uint64_t slab = c->pool().slab_bytes();
    std::vector<float> device(150'000, 1.0f), host(150'000, 2.0f), back(150'000);
    const uint64_t n = device.size() * 4;  // three slabs
    std::vector<TensorSpec> on_device = {{"a", "float32", {150'000}, device.data(), n, 0, 0}};
    std::vector<TensorSpec> on_host = {{"a", "float32", {150'000}, host.data(), n}};
    gpu.hung = true;
    auto h1 = c->save(1, on_device, {}, true, mode);
    std::shared_ptr<DeviceCopies> copies;  // to see the late copies land
    if (mode == SaveMode::kOverlap) {
      ASSERT_TRUE(h1.ok()) << h1.status().to_string();
      EXPECT_EQ((*h1)->wait(30s).code(), StatusCode::kTimeout);
    } else {
      EXPECT_EQ(h1.status().code(), StatusCode::kTimeout) << h1.status().to_string();
    }
    EXPECT_EQ(c->pool().in_use_bytes(), 3 * slab) << "slabs of pending copies are held";
    EXPECT_EQ(*c->steps(), std::vector<int64_t>{});
    // Step 2 is saved from other slabs while the copies are pending; then they land.
    auto h2 = c->save(2, on_host, {});
    ASSERT_TRUE(h2.ok());
    gpu.hung = false;
    if (h1.ok())
      ASSERT_TRUE((*h1)->wait_snapshot(10s).ok());
    else {
      std::lock_guard<std::mutex> lock(gpu.mu);
      for (auto& [stream, ops] : gpu.queued) gpu.flush(stream, SIZE_MAX);
    }
    ASSERT_TRUE((*h2)->wait(30s).ok());
    auto m = c->manifest(2);
    ASSERT_TRUE(m.ok());
    std::vector<ReadTarget> t = {{"a", back.data(), n}};
    ASSERT_TRUE(c->read(*m, t).ok());
    EXPECT_EQ(back, host) << "a late copy landed in step 2's slabs";
    EXPECT_EQ(c->pool().in_use_bytes(), 3 * slab);
    auto h3 = c->save(3, on_host, {});  // the completed copies' slabs are returned first
    ASSERT_TRUE(h3.ok() && (*h3)->wait(30s).ok());
    EXPECT_EQ(c->pool().in_use_bytes(), 0u);
  }
}

}  // namespace
}  // namespace resilient::checkpoint
