#pragma once
// Reading from the page cache what is already there. A checkpoint is written and read O_DIRECT
// (no second copy in the cache, no eviction of the job's own pages), but after a restart on the
// same host, or on a small machine whose cache held the files anyway, the cache has the bytes
// and O_DIRECT would fetch them from the device again. A reader asks CachedPages which ranges
// are resident (mincore: no I/O is started), reads those with read_cached() from a buffered
// descriptor of the same file (preadv2 RWF_NOWAIT: it never waits for the device), and reads
// the rest, including whatever was evicted in between, O_DIRECT.

#include <cstdint>

#include "resilient/common/status.hpp"
#include "resilient/io/file.hpp"

namespace resilient::io {

/// Which pages of a file are in the page cache. Maps the file read-only (nothing is read:
/// mincore() looks the pages up without faulting them in). Move-only; thread-safe (const).
class CachedPages {
 public:
  CachedPages() = default;
  ~CachedPages();
  CachedPages(CachedPages&& other) noexcept;
  CachedPages& operator=(CachedPages&& other) noexcept;
  CachedPages(const CachedPages&) = delete;
  CachedPages& operator=(const CachedPages&) = delete;

  /// Maps `file` (either O_DIRECT or buffered). An error (mmap refused: kIoError with errno)
  /// means no range can be asked about; an empty file maps to nothing.
  static Result<CachedPages> map(const File& file);

  /// True when every page holding a byte of [offset, offset + len) is in the page cache. False
  /// for an empty range, one past the end of the mapped size, and when mincore() fails.
  bool resident(uint64_t offset, uint64_t len) const;

 private:
  void* base_ = nullptr;
  uint64_t size_ = 0;
};

/// Reads up to `n` bytes at `offset` of `file` into `buf`, only from the page cache (preadv2
/// with RWF_NOWAIT, through the kRead file hook): returns the bytes read, fewer than `n` (0 when
/// the first page is not cached) where a page is missing; it never waits for the device. Short
/// only at a missing page or at the end of the file. `file` must be buffered
/// (kInvalidArgument for an O_DIRECT file, where RWF_NOWAIT means something else);
/// kUnavailable (errno EOPNOTSUPP) where the kernel or the file system lack RWF_NOWAIT; other
/// errors as kIoError with errno, path and offset.
Result<uint64_t> read_cached(const File& file, void* buf, uint64_t n, uint64_t offset);

}  // namespace resilient::io
