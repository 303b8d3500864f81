#pragma once
// The CUDA runtime entry points resilient uses, resolved with dlsym (or faked in tests). The
// types are declared here as their ABI (ints and pointers) so no CUDA header is needed.

#include <string>

#include "resilient/common/config.hpp"
#include "resilient/memory/cuda.hpp"

namespace resilient::memory {

struct CudaRuntime::Table {
  using Error = int;  // cudaError_t
  Error (*get_device_count)(int*) = nullptr;
  Error (*set_device)(int) = nullptr;
  Error (*get_device)(int*) = nullptr;
  Error (*host_alloc)(void**, size_t, unsigned) = nullptr;
  Error (*free_host)(void*) = nullptr;
  Error (*host_register)(void*, size_t, unsigned) = nullptr;
  Error (*host_unregister)(void*) = nullptr;
  Error (*memcpy_async)(void*, const void*, size_t, int, void*) = nullptr;
  // cudaMemcpyBatchAsync as CUDA 13 declares it (12.8's took a failIdx more); optional: null
  // where the runtime is older or RESILIENT_COPY_BATCH=0.
  Error (*memcpy_batch_async)(void* const*, const void* const*, const size_t*, size_t, void*,
                              size_t*, size_t, void*) = nullptr;
  Error (*stream_create_with_flags)(void**, unsigned) = nullptr;
  Error (*stream_destroy)(void*) = nullptr;
  Error (*event_create_with_flags)(void**, unsigned) = nullptr;
  Error (*event_destroy)(void*) = nullptr;
  Error (*event_record)(void*, void*) = nullptr;
  Error (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  Error (*event_query)(void*) = nullptr;
  Error (*stream_synchronize)(void*) = nullptr;
  const char* (*get_error_string)(Error) = nullptr;
  Error (*get_last_error)() = nullptr;  // reads and clears the calling thread's last error
};

namespace detail {

// The values of the few CUDA enums and flags used (stable across CUDA 11-13).
inline constexpr int kCudaSuccess = 0;
inline constexpr int kCudaErrorMemoryAllocation = 2;
inline constexpr int kCudaErrorNotReady = 600;
inline constexpr unsigned kCudaHostAllocPortable = 1;
inline constexpr unsigned kCudaHostRegisterPortable = 1;
inline constexpr unsigned kCudaStreamNonBlocking = 1;
inline constexpr unsigned kCudaEventDisableTiming = 2;
inline constexpr int kCudaMemcpySrcAccessOrderStream = 1;
inline constexpr int kFirstBatchRuntime = 13000;  // cudaRuntimeGetVersion of CUDA 13.0

/// cudaMemcpyAttributes (CUDA 12.8+): the source access order, two location hints (a location
/// type and id each), flags.
struct MemcpyAttributes {
  int src_access_order = kCudaMemcpySrcAccessOrderStream;
  int src_hint[2] = {0, 0};
  int dst_hint[2] = {0, 0};
  unsigned flags = 0;
};
static_assert(sizeof(MemcpyAttributes) == 24);

/// The outcome of loading the runtime: a table (owned, never freed) or the reason there is none.
struct CudaLoad {
  const CudaRuntime::Table* table = nullptr;
  std::string reason;
};

/// Loads libcudart (RESILIENT_CUDART_PATH if given, else libcudart.so.13, .12, libcudart.so, also
/// under /usr/local/cuda/lib64) and checks for a device. Uncached; get() caches it.
/// mode kOff returns no table without loading; kOn turns absence into std::runtime_error.
CudaLoad load_cuda_runtime(Feature mode, const std::string& path_override);

}  // namespace detail
}  // namespace resilient::memory
