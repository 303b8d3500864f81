#pragma once
// Persist: writes a snapshot's slabs to the rank's data file (io_uring, O_DIRECT), computing an
// xxHash3 checksum per chunk and optionally compressing each chunk with zstd.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

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

/// Where persist_files cuts the image `layout` into at most `files` data files: ascending
/// offsets, the first 0 and the last layout.bytes; every inner cut is the start of a tensor
/// placed on a 4 KiB boundary (one of kPackBelowBytes or more), the one nearest to i/files of
/// the image. Fewer files when the image has too few such tensors.
std::vector<uint64_t> plan_file_cuts(const Layout& layout, size_t files);

/// A data file that persist_files wrote.
struct PersistedFile {
  std::string name;
  uint64_t bytes = 0;
};

/// persist_shard over several files written at once, each by its own thread and io engine
/// (`engines`, one per file at most): the page cache serializes a file's writes on its inode
/// lock, so one file caps a rank's write rate (benchmarks/RESULTS.md, "per-process pipeline
/// ceiling"). File i is named names[i] and holds the bytes between cuts i and i+1 of
/// plan_file_cuts(layout, min(names, engines)); each tensor's `shard` is set to its file's index
/// and its chunk offsets become offsets in that file. Uncompressed images only (zstd_level 0).
/// Every file is fsynced before it returns; on error the files hold unspecified bytes.
Result<std::vector<PersistedFile>> persist_files(Staging& staging, const io::Dir& dir,
                                                 const std::vector<std::string>& names,
                                                 const PersistOptions& options,
                                                 std::span<io::IoEngine* const> engines,
                                                 ThreadPool& workers);

/// XXH3 64-bit checksum (the format's chunk checksum).
uint64_t checksum(const void* data, uint64_t n);

}  // namespace resilient::checkpoint
