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
  size_t request = 0;     // index of the request it belongs to
  uint64_t done = 0;      // bytes transferred so far
  int zero_progress = 0;  // consecutive transfers that moved no bytes (writes)
};

/// Splits requests into pieces; kInvalidArgument for misaligned requests on direct files.
Result<std::vector<Piece>> split_requests(const File& file, std::span<const IoRequest> requests,
                                          uint64_t request_bytes);

/// IoEngine::read_stream() in batches: up to `batch` requests of one file from `stream`, read
/// with `engine.read()` (done() per request as it completes), again until the stream has none.
Status read_stream_in_batches(IoEngine& engine, ReadStream& stream, Duration timeout, size_t batch);

/// Tracks which requests of a read are complete, for IoEngine::ReadDone: each request counts
/// its pieces down; a request whose last piece is done becomes ready for its callback.
class RequestCompletion {
 public:
  RequestCompletion(std::span<const Piece> pieces, size_t requests);
  /// Piece `p` is done; true when that completed its request (now in ready()).
  bool piece_done(const Piece& p);
  /// The requests completed since the last take() (in completion order).
  std::span<const size_t> take();
  bool pending() const { return next_ < ready_.size(); }
  /// Runs `done` (when given) for every request take() returns; the first non-OK status stops
  /// it and is returned.
  Status run(const ReadDone& done);

 private:
  std::vector<size_t> left_;   // pieces not yet done, per request
  std::vector<size_t> ready_;  // completed requests in completion order
  size_t next_ = 0;            // ready_[next_...] have not been taken yet
};

/// What to do after a transfer of a piece returned `res` (bytes, or -errno).
enum class Next { kDone, kResubmit, kFail };

/// Applies a transfer result to `piece`: advances on progress, resubmits on short transfers and
/// EAGAIN/EINTR, and otherwise sets `error` (with path and offset) and returns kFail.
Next apply_result(Direction dir, const File& file, Piece& piece, int64_t res, Status& error);

/// The error for a transfer that failed with `err` at `offset`.
Status transfer_error(Direction dir, const File& file, int err, uint64_t offset);

inline const char* direction_name(Direction d) { return d == Direction::kWrite ? "write" : "read"; }

}  // namespace resilient::io::detail
