#pragma once
// The CUDA runtime, loaded at run time with dlopen (libcudart.so.13, .12, then libcudart.so), so
// one build runs on machines with and without CUDA. RESILIENT_CUDA=auto|on|off (auto: use it when
// a device is present; on: absence is an error; off: never load it).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>

#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"

namespace resilient::memory {

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice, kDefault };

/// Opaque CUDA handles carried as integers (cudaStream_t / cudaEvent_t). 0 is the legacy default
/// stream.
using StreamHandle = uintptr_t;
using EventHandle = uintptr_t;

/// One copy of a batch.
struct DeviceCopy {
  void* dst;
  const void* src;
  size_t bytes;
};

/// Thin, thread-safe wrapper over the functions resilient uses. Obtain it with get().
class CudaRuntime {
 public:
  /// The loaded runtime, or nullptr when CUDA is off, absent, or no device is visible (the
  /// reason is logged once). With RESILIENT_CUDA=on, absence throws std::runtime_error.
  static const CudaRuntime* get();
  /// Why get() returned nullptr ("" when it did not).
  static const char* unavailable_reason();

  int device_count() const;
  Status set_device(int device) const;
  Result<int> get_device() const;

  Status host_alloc(void** ptr, size_t bytes) const;  // cudaHostAlloc(..., cudaHostAllocPortable)
  Status host_free(void* ptr) const;
  Status host_register(void* ptr, size_t bytes) const;
  Status host_unregister(void* ptr) const;

  Status memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind,
                      StreamHandle stream) const;
  /// Queues `copies` (independent: no copy reads another's destination) on `stream`, in
  /// stream order as memcpy_async would. One cudaMemcpyBatchAsync where the runtime has it
  /// (CUDA 13+, RESILIENT_COPY_BATCH=1) and `stream` is not the legacy default stream, else
  /// one cudaMemcpyAsync each (also from the first failed batch on, logged once): a thousand
  /// copies take milliseconds of the caller's time one by one.
  Status memcpy_batch_async(std::span<const DeviceCopy> copies, CopyKind kind,
                            StreamHandle stream) const;
  /// Whether memcpy_batch_async still uses the batch call.
  bool batches_copies() const;
  Status stream_create(StreamHandle* stream) const;  // non-blocking stream
  Status stream_destroy(StreamHandle stream) const;
  Status event_create(EventHandle* event) const;  // timing disabled
  Status event_destroy(EventHandle event) const;
  Status event_record(EventHandle event, StreamHandle stream) const;
  Status stream_wait_event(StreamHandle stream, EventHandle event) const;
  /// True when the event has completed; an error status for a sticky CUDA error.
  Result<bool> event_query(EventHandle event) const;
  /// Polls the event until it completes or `timeout` passes (kTimeout).
  Status event_wait(EventHandle event, Duration timeout) const;
  Status stream_synchronize(StreamHandle stream) const;

  struct Table;  // resolved entry points (detail)
  explicit CudaRuntime(const Table* table) : t_(table) {}

 private:
  const Table* t_;
  mutable std::atomic<bool> batch_{true};
};

/// Puts the calling thread's current device back, if it changed, when it goes out of scope. The
/// engine switches devices to reach each device's streams; a caller's thread (PyTorch's) must not
/// notice. Only for callers' threads: on a fresh thread it would pin device 0's context.
class DeviceGuard {
 public:
  explicit DeviceGuard(const CudaRuntime* cuda);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  const CudaRuntime* cuda_;
  int device_ = -1;
};

}  // namespace resilient::memory
