#pragma once
// Shared by both engines: splitting requests into pieces of at most request_bytes, alignment
// checks for O_DIRECT files, and the rules for interpreting one transfer's result.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "resilient/common/status.hpp"
#include "resilient/io/engine.hpp"

namespace resilient::io::detail {

enum class Direction { kWrite, kRead };

/// One piece of a request, with its progress.
struct Piece {
  std::byte* buf;
  uint64_t len;
  uint64_t offset;
  uint64_t done = 0;      // bytes transferred so far
  int zero_progress = 0;  // consecutive transfers that moved no bytes (writes)
};

/// Splits requests into pieces; kInvalidArgument for misaligned requests on direct files.
Result<std::vector<Piece>> split_requests(const File& file, std::span<const IoRequest> requests,
                                          uint64_t request_bytes);

/// What to do after a transfer of a piece returned `res` (bytes, or -errno).
enum class Next { kDone, kResubmit, kFail };

/// Applies a transfer result to `piece`: advances on progress, resubmits on short transfers and
/// EAGAIN/EINTR, and otherwise sets `error` (with path and offset) and returns kFail.
Next apply_result(Direction dir, const File& file, Piece& piece, int64_t res, Status& error);

/// The error for a transfer that failed with `err` at `offset`.
Status transfer_error(Direction dir, const File& file, int err, uint64_t offset);

inline const char* direction_name(Direction d) { return d == Direction::kWrite ? "write" : "read"; }

}  // namespace resilient::io::detail
