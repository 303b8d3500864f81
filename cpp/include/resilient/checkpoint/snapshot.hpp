#pragma once
// Snapshot: copies the caller's tensors into pool slabs, laid out as one logical shard image
// (small tensors packed, large ones 4 KiB-aligned), so the caller may modify its tensors as
// soon as snapshot() returns.

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "resilient/checkpoint/format.hpp"
#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"
#include "resilient/common/thread_pool.hpp"
#include "resilient/memory/cuda.hpp"
#include "resilient/memory/pool.hpp"

namespace resilient::checkpoint {

/// A tensor to save, described as a buffer: the bindings build these from torch tensors without
/// linking libtorch. `data` must stay valid and unmodified until snapshot() returns.
struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  uint64_t nbytes = 0;
  int device = -1;                    // -1: host memory; >= 0: CUDA device ordinal
  memory::StreamHandle stream = 0;    // the caller's stream that produced the data (CUDA)
  std::vector<int64_t> global_shape;  // optional: this tensor is a slice of a global tensor
  std::vector<int64_t> global_offset;
};

/// The logical image of one shard (plan_layout); chunk offsets in `tensors` are logical offsets
/// (== file offsets when stored uncompressed) and carry no checksum yet.
struct Layout {
  std::vector<TensorEntry> tensors;
  uint64_t bytes = 0;  // aligned end of the image
};

/// Tensors smaller than this are packed one after the other (each at a multiple of its element
/// size); larger ones start on a 4 KiB boundary. A state of many small tensors then costs its
/// payload on disk, and an aligned tensor wastes less than 1/16 of its size in padding.
inline constexpr uint64_t kPackBelowBytes = 64 << 10;

/// Places tensors in order: small ones (below kPackBelowBytes) packed, the others at 4 KiB-aligned
/// offsets; the image ends on a 4 KiB boundary. Splits each into chunks of at most
/// `chunk_bytes` that never cross a slab boundary. Validates names (unique, non-empty), dtypes
/// and nbytes against shape (kInvalidArgument naming the tensor).
Result<Layout> plan_layout(std::span<const TensorSpec> tensors, uint64_t slab_bytes,
                           uint64_t chunk_bytes);

struct DeviceCopies;

/// The engine's device-to-host copy streams, `per_device` per CUDA device (slabs are spread
/// over them: one stream's queue of pending work is bounded, and a full queue would make
/// issuing block), created on first use and reused by every save. Thread-safe.
class DeviceStreams {
 public:
  /// `cuda` may be null (no device copies possible).
  explicit DeviceStreams(const memory::CudaRuntime* cuda, int per_device = 4)
      : cuda_(cuda), per_device_(per_device < 1 ? 1 : per_device) {}
  ~DeviceStreams();
  DeviceStreams(const DeviceStreams&) = delete;
  DeviceStreams& operator=(const DeviceStreams&) = delete;

  const memory::CudaRuntime* cuda() const { return cuda_; }
  int per_device() const { return per_device_; }
  /// Copy stream `index` (< per_device()) of `device`; sets that device current on the thread.
  Result<memory::StreamHandle> get(int device, int index = 0);

  /// Keeps `slab` (slab `index` of `copies`, whose device-to-host copies are not known to have
  /// completed, say after a copy timeout) out of its pool until they have: a late copy must land
  /// in a slab no other checkpoint uses. reap() returns it once its events completed; one still
  /// held when this object is destroyed (after its streams were synchronized) is leaked, with a
  /// warning, never returned.
  void quarantine(std::shared_ptr<DeviceCopies> copies, size_t index, memory::Slab slab);
  /// Returns the quarantined slabs whose copies completed to their pool (non-blocking); the
  /// number still held.
  size_t reap();

 private:
  struct Held {
    std::shared_ptr<DeviceCopies> copies;
    size_t index;
    memory::Slab slab;
  };
  const memory::CudaRuntime* cuda_;
  const int per_device_;
  std::mutex mu_;
  std::vector<std::pair<int, memory::StreamHandle>>
      streams_;  // (device * per_device + index, stream)
  std::mutex quarantine_mu_;
  std::vector<Held> quarantine_;
};

/// Device-to-host copies are queued in groups of consecutive slabs of about this many bytes
/// (one batch call and one event per group and device): a save of a few GiB in 64 MiB slabs
/// then makes tens of calls, not a hundred or more, on the caller's thread.
inline constexpr uint64_t kCopyGroupBytes = 256ull << 20;

/// The asynchronous device-to-host copies of one snapshot: slab i's bytes are valid once every
/// event in slab_events[i] has completed (an event may close the copies of several slabs).
/// Shared by the staging and the save handle (whose wait_snapshot() waits on it); the
/// destructor waits for and destroys the events. Thread-safe.
struct DeviceCopies {
  const memory::CudaRuntime* cuda = nullptr;
  std::vector<memory::EventHandle> events;  // each once, owned
  std::vector<std::vector<memory::EventHandle>> slab_events;

  DeviceCopies() = default;
  DeviceCopies(const DeviceCopies&) = delete;
  DeviceCopies& operator=(const DeviceCopies&) = delete;
  ~DeviceCopies();
  /// Waits for the copies into slab `i` (ok at once for a slab with none).
  Status wait_slab(size_t i, Duration timeout) const;
  /// Whether every copy into slab `i` completed, without waiting (false on a CUDA error: a
  /// copy that failed is not known to be finished).
  bool slab_done(size_t i) const;
  /// Waits for every copy.
  Status wait_all(Duration timeout) const;
  /// Makes `stream` wait, on the device, for every copy: work queued on it afterwards cannot
  /// change the copied tensors, and the calling thread does not block.
  Status fence(memory::StreamHandle stream) const;
};

/// A snapshot held in slabs. Slab i holds logical bytes [i * slab_bytes, (i + 1) * slab_bytes).
/// Move-only. Destroying it (or release_slabs()) never returns a slab into which a device copy
/// may still write: such slabs go to the streams' quarantine.
struct Staging {
  Staging() = default;
  Staging(Staging&&) noexcept = default;
  Staging& operator=(Staging&&) noexcept = default;
  ~Staging() { release_slabs(); }

  Layout layout;
  uint64_t slab_bytes = 0;
  std::vector<memory::Slab> slabs;
  std::shared_ptr<DeviceCopies> copies;  // null when every tensor was in host memory
  DeviceStreams* streams = nullptr;      // set with `copies`: quarantines their unfinished slabs

  /// Returns every slab still held whose device copies are known complete (or that has none) to
  /// the pool, and quarantines the others (DeviceStreams::quarantine). Does not wait.
  void release_slabs();

  Status wait_slab(size_t i, Duration timeout) const {
    return copies ? copies->wait_slab(i, timeout) : ok_status();
  }
};

/// Copies `tensors` into slabs from `pool`: host tensors with parallel memcpy on `copies` before
/// returning; device tensors with cudaMemcpyAsync on `streams`' copy streams, ordered after each
/// tensor's producing stream with an event, and NOT waited for: the
/// caller must keep device tensors alive and unmodified until staging.copies->wait_all(). Fails
/// with kResourceExhausted when the shard is larger than the pool's budget, kTimeout when slabs do
/// not free up within `timeout`, kUnavailable for device tensors when CUDA is not usable. Returns
/// `streams`' quarantined slabs whose copies have completed to the pool first.
/// `copy_group_bytes`: consecutive slabs whose device copies share a batch call and an event.
Result<Staging> snapshot(std::span<const TensorSpec> tensors, memory::HostPool& pool,
                         ThreadPool& copies, uint64_t chunk_bytes, Duration timeout,
                         DeviceStreams* streams = nullptr,
                         uint64_t copy_group_bytes = kCopyGroupBytes);

/// A tensor of a staging that restage() keeps: its index in the staging's layout, and the name
/// and global placement it is saved under.
struct Restaged {
  size_t index = 0;
  std::string name;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> global_offset;
};

/// Turns `staging` (whose device copies have completed) into the image snapshot() would make of
/// the kept tensors, in their staging order and under their new names, followed by the host
/// tensors `extra`, copied in. A kept tensor's bytes only move toward the start of the image
/// (plan_layout of a subset places every tensor at or before its old offset), so the bytes are
/// moved in place, front to back; slabs past the new end go back to `pool`, and slabs for
/// `extra` come from it (waiting up to `timeout`). kInvalidArgument for an index out of range or
/// kept twice, a device tensor in `extra`, or a name plan_layout refuses; the staging is unchanged
/// then.
Status restage(Staging& staging, std::span<const Restaged> keep, std::span<const TensorSpec> extra,
               memory::HostPool& pool, uint64_t chunk_bytes, Duration timeout);

}  // namespace resilient::checkpoint
