// The dlopen CUDA shim: loading rules on a machine without a GPU, and the wrapper's error
// mapping and event_wait timeout against a fake entry-point table.

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>

#include "memory/detail/cuda_table.hpp"
#include "resilient/memory/cuda.hpp"

namespace resilient::memory {
namespace {

TEST(CudaLoad, OffSkipsLoading) {
  auto load = detail::load_cuda_runtime(Feature::kOff, "");
  EXPECT_EQ(load.table, nullptr);
  EXPECT_NE(load.reason.find("RESILIENT_CUDA=off"), std::string::npos);
}

TEST(CudaLoad, MissingLibraryGivesReason) {
  auto load = detail::load_cuda_runtime(Feature::kAuto, "/nonexistent/libcudart.so.99");
  EXPECT_EQ(load.table, nullptr);
  EXPECT_NE(load.reason.find("not found"), std::string::npos) << load.reason;
  EXPECT_THROW(detail::load_cuda_runtime(Feature::kOn, "/nonexistent/libcudart.so.99"),
               std::runtime_error);
}

TEST(CudaLoad, NoDeviceHereMeansUnavailable) {
  auto load = detail::load_cuda_runtime(Feature::kAuto, "");
  if (load.table != nullptr) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(load.reason.empty());
  // Either the library is absent or it loaded and found no device.
  const bool explained = load.reason.find("not found") != std::string::npos ||
                         load.reason.find("device") != std::string::npos;
  EXPECT_TRUE(explained) << load.reason;
}

TEST(CudaRuntimeGet, HonoursCudaOff) {
  // get() caches its first answer for the process; this is the only test that calls it.
  ::setenv("RESILIENT_CUDA", "off", 1);
  EXPECT_EQ(CudaRuntime::get(), nullptr);
  EXPECT_NE(std::string(CudaRuntime::unavailable_reason()).find("off"), std::string::npos);
  ::unsetenv("RESILIENT_CUDA");
}

// --- the wrapper over a fake table --------------------------------------------------------

std::atomic<int> g_queries{0};
int g_query_result = detail::kCudaErrorNotReady;

int fake_count(int* n) {
  *n = 2;
  return 0;
}
int fake_set_device(int d) { return d < 2 ? 0 : 101; }  // cudaErrorInvalidDevice
int fake_get_device(int* d) {
  *d = 1;
  return 0;
}
int fake_query(void*) {
  ++g_queries;
  return g_query_result;
}
int fake_event_create(void** e, unsigned flags) {
  *e = reinterpret_cast<void*>(uintptr_t{0x1234});
  return flags == detail::kCudaEventDisableTiming ? 0 : 1;
}
int fake_memcpy(void*, const void*, size_t, int kind, void*) { return kind == 1 ? 0 : 1; }
const char* fake_error_string(int e) { return e == 101 ? "invalid device ordinal" : "other"; }

CudaRuntime::Table make_table() {
  CudaRuntime::Table t;
  t.get_device_count = fake_count;
  t.set_device = fake_set_device;
  t.get_device = fake_get_device;
  t.event_query = fake_query;
  t.event_create_with_flags = fake_event_create;
  t.memcpy_async = fake_memcpy;
  t.get_error_string = fake_error_string;
  return t;
}

TEST(CudaRuntimeFake, DevicesAndErrors) {
  static const CudaRuntime::Table table = make_table();
  CudaRuntime cuda(&table);
  EXPECT_EQ(cuda.device_count(), 2);
  EXPECT_TRUE(cuda.set_device(1).ok());
  Status bad = cuda.set_device(5);
  EXPECT_EQ(bad.code(), StatusCode::kInternal);
  EXPECT_NE(bad.message().find("invalid device ordinal"), std::string::npos);
  EXPECT_EQ(*cuda.get_device(), 1);
  EventHandle e = 0;
  ASSERT_TRUE(cuda.event_create(&e).ok());
  EXPECT_EQ(e, 0x1234u);
  EXPECT_TRUE(cuda.memcpy_async(nullptr, nullptr, 0, CopyKind::kHostToDevice, 0).ok());
  EXPECT_FALSE(cuda.memcpy_async(nullptr, nullptr, 0, CopyKind::kDeviceToHost, 0).ok());
}

TEST(CudaRuntimeFake, EventWaitTimesOutAndCompletes) {
  static const CudaRuntime::Table table = make_table();
  CudaRuntime cuda(&table);
  g_query_result = detail::kCudaErrorNotReady;
  EXPECT_FALSE(*cuda.event_query(1));
  Status s = cuda.event_wait(1, std::chrono::milliseconds(20));
  EXPECT_EQ(s.code(), StatusCode::kTimeout);
  EXPECT_GT(g_queries.load(), 2);
  g_query_result = detail::kCudaSuccess;
  EXPECT_TRUE(cuda.event_wait(1, std::chrono::milliseconds(20)).ok());
  g_query_result = 700;  // a sticky error is reported, not waited out
  EXPECT_EQ(cuda.event_wait(1, std::chrono::seconds(10)).code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace resilient::memory
