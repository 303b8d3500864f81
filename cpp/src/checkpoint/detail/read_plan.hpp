#pragma once
// Restore's read planning, as pure functions: which aligned byte ranges of which shard files to
// read, which stored chunks each range holds, and how many reader threads and host slabs read
// them. restore.cpp executes the plan.
//
// Why the shapes: data files may be opened O_DIRECT, so every read starts and ends on a
// kDirectAlignment boundary. Chunks of one shard that lie together are read as one range (an
// "extent") as long as it fits one engine request (and a pool slab), so small tensors cost one
// read, not one each, and each extent's chunks can be checked and placed as soon as it is in.
// Each reader thread reads one extent into each of its buffers (slabs) and claims the next
// extent, in file order, whenever a buffer is free: the threads together keep about the
// engine's queue depth of requests in flight, in the order the device (and an I/O scheduler
// such as mq-deadline, which serves by position) reads them. A thread has one buffer more than
// it keeps in flight: when a read completes, the next is issued into the spare buffer before
// the completed one is checked and placed, so the device never waits for the checks (it answers
// the requests in flight together, so with every buffer in flight all of them arrived at once
// and nothing was read while they were checked: 0.65x raw on the 2-core VM). All threads'
// buffers stay within the pool's budget, or threads holding some slabs could wait for each
// other's until the timeout.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace resilient::checkpoint::detail {

/// Where one stored chunk lies: a byte range of one shard's data file.
struct ChunkLocation {
  uint32_t shard = 0;
  uint64_t offset = 0;
  uint64_t len = 0;
};

/// One aligned read: bytes [offset, offset + len) of `shard`, holding the chunks
/// order[first, last) of the plan (each at buffer offset chunk.offset - offset).
struct Extent {
  uint32_t shard = 0;
  uint64_t offset = 0;  ///< a multiple of kDirectAlignment
  uint64_t len = 0;     ///< a multiple of kDirectAlignment
  size_t first = 0, last = 0;
};

/// What bounds a plan: the host pool's slab and budget sizes, the restore's reader threads and
/// the I/O engine's queue.
struct ReadLimits {
  uint64_t slab_bytes = 0;     ///< > 0, a multiple of kDirectAlignment
  uint64_t budget_bytes = 0;   ///< the pool's budget; below one slab counts as one slab
  int threads = 1;             ///< reader threads wanted (< 1 counts as 1)
  uint64_t queue_depth = 1;    ///< I/O engine queue depth
  uint64_t request_bytes = 0;  ///< I/O engine request size
};

struct ReadPlan {
  /// Indices into the chunk list, sorted by (shard, offset).
  std::vector<size_t> order;
  /// Extents in order; each covers its chunks, no two share a chunk. Claimed one at a time.
  std::vector<Extent> extents;
  size_t threads = 1;    ///< reader threads to run (<= extents, >= 1)
  size_t in_flight = 1;  ///< requests each thread keeps in flight (its engine's queue depth)
  size_t buffers = 1;    ///< slabs each thread reads extents into: in_flight + 1 (or 1)
};

/// The first chunk (index into `chunks`) that does not lie within its file: its end past the
/// file's size, or its aligned end past the file's aligned size. nullopt when all fit (the
/// precondition of plan_reads). `file_sizes` is indexed by shard.
std::optional<size_t> find_chunk_past_end(std::span<const ChunkLocation> chunks,
                                          std::span<const uint64_t> file_sizes);

/// The plan for reading `chunks` within `limits`. Every chunk is read by exactly one extent;
/// an extent longer than a request holds exactly one chunk (one longer than a slab gets a buffer
/// of its own from the reader). No extent ends past its file's aligned size when
/// find_chunk_past_end() found none. Pure: no I/O, no clock.
ReadPlan plan_reads(std::span<const ChunkLocation> chunks, const ReadLimits& limits);

}  // namespace resilient::checkpoint::detail
