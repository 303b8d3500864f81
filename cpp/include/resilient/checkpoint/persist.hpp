#pragma once
// Persist: writes a snapshot's slabs to the rank's data file (io_uring, O_DIRECT), computing an
// xxHash3 checksum per chunk and optionally compressing each chunk with zstd.

#include <cstdint>
#include <string>

#include "resilient/checkpoint/format.hpp"
#include "resilient/checkpoint/snapshot.hpp"
#include "resilient/common/thread_pool.hpp"
#include "resilient/io/engine.hpp"
#include "resilient/io/file.hpp"

namespace resilient::checkpoint {

struct PersistOptions {
  int zstd_level = 0;  // 0: store chunks uncompressed
  Feature direct = Feature::kAuto;
  Duration timeout = std::chrono::seconds(600);
};

/// Writes `staging` to the file `name` of `dir` (opened relative to it, never through a symbolic
/// link) and fsyncs it. Fills each chunk's checksum (and, with compression,
/// its stored offset, length and codec) into staging.layout. Releases each slab back to the pool
/// as soon as its bytes are on their way to storage, so a following snapshot can reuse them.
/// Returns the file's size. Errors name the file and offset (kNoSpace for ENOSPC).
Result<uint64_t> persist_shard(Staging& staging, const io::Dir& dir, const std::string& name,
                               const PersistOptions& options, io::IoEngine& engine,
                               ThreadPool& workers);

/// XXH3 64-bit checksum (the format's chunk checksum).
uint64_t checksum(const void* data, uint64_t n);

}  // namespace resilient::checkpoint
