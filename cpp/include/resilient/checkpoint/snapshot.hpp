#pragma once
// Snapshot: copies the caller's tensors into pool slabs, packed at 4 KiB-aligned offsets of one
// logical shard image, so the caller may modify its tensors as soon as snapshot() returns.

#include <cstdint>
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
  int device = -1;                      // -1: host memory; >= 0: CUDA device ordinal
  memory::StreamHandle stream = 0;      // the caller's stream that produced the data (CUDA)
  std::vector<int64_t> global_shape;    // optional: this tensor is a slice of a global tensor
  std::vector<int64_t> global_offset;
};

/// The logical image of one shard: tensors packed at aligned offsets; chunk offsets in `tensors`
/// are logical offsets (== file offsets when stored uncompressed) and carry no checksum yet.
struct Layout {
  std::vector<TensorEntry> tensors;
  uint64_t bytes = 0;  // aligned end of the image
};

/// Places tensors in order at 4 KiB-aligned offsets; splits each into chunks of at most
/// `chunk_bytes` that never cross a slab boundary. Validates names (unique, non-empty), dtypes
/// and nbytes against shape (kInvalidArgument naming the tensor).
Result<Layout> plan_layout(std::span<const TensorSpec> tensors, uint64_t slab_bytes, uint64_t chunk_bytes);

/// A snapshot held in slabs. Slab i holds logical bytes [i * slab_bytes, (i + 1) * slab_bytes).
struct Staging {
  Layout layout;
  uint64_t slab_bytes = 0;
  std::vector<memory::Slab> slabs;
};

/// Copies `tensors` into slabs from `pool` using `copies` (host memcpy in parallel). Fails with
/// kResourceExhausted when the shard is larger than the pool's budget, kTimeout when slabs do not
/// free up within `timeout`, kUnavailable for device tensors when CUDA is not usable.
Result<Staging> snapshot(std::span<const TensorSpec> tensors, memory::HostPool& pool, ThreadPool& copies,
                         uint64_t chunk_bytes, Duration timeout);

}  // namespace resilient::checkpoint
