#pragma once
// Host-to-device copies of one restore reader thread: a copy stream per device, and per staging
// buffer (one of `buffers`, numbered by the reader) the events that must complete before the
// buffer is written again.

#include <cstdint>
#include <utility>
#include <vector>

#include "resilient/common/status.hpp"
#include "resilient/memory/cuda.hpp"

namespace resilient::checkpoint::detail {

/// Not thread-safe: one per reader thread. Every method but the constructor needs CUDA
/// (kUnavailable without it for copy(); the others do nothing).
class DeviceWriter {
 public:
  DeviceWriter(const memory::CudaRuntime* cuda, size_t buffers);
  /// Closes and waits for every copy still pending (a restore that failed midway), so the
  /// staging buffers may go back to the pool after it.
  ~DeviceWriter();
  DeviceWriter(const DeviceWriter&) = delete;
  DeviceWriter& operator=(const DeviceWriter&) = delete;

  /// Copies n bytes from staging buffer `buf` to device memory, asynchronously.
  Status copy(int device, void* dst, const void* src, uint64_t n, size_t buf);
  /// Closes buffer `buf`'s batch of copies with events.
  Status close(size_t buf);
  /// Waits until buffer `buf` may be written again (its closed copies are done).
  Status reuse(size_t buf);
  /// Waits for every closed copy.
  Status drain();

 private:
  Result<memory::StreamHandle> stream_for(int device);
  Status wait(std::vector<memory::EventHandle>& events);

  const memory::CudaRuntime* cuda_;
  std::vector<std::pair<int, memory::StreamHandle>> streams_;
  std::vector<std::vector<std::pair<int, memory::StreamHandle>>> used_;  // per buffer
  std::vector<std::vector<memory::EventHandle>> pending_;                // per buffer
};

}  // namespace resilient::checkpoint::detail
