#include "io/detail/transfer.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <optional>
#include <utility>

namespace resilient::io::detail {
namespace {

// A write that keeps returning 0 bytes would otherwise spin forever.
constexpr int kMaxZeroProgress = 16;

bool aligned(uint64_t x) { return x % kDirectAlignment == 0; }

}  // namespace

Result<std::vector<Piece>> split_requests(const File& file, std::span<const IoRequest> requests,
                                          uint64_t request_bytes) {
  std::vector<Piece> pieces;
  for (const IoRequest& r : requests) {
    if (r.len == 0) continue;
    if (r.buf == nullptr) {
      return Status(StatusCode::kInvalidArgument, "I/O request with a null buffer")
          .with_path(file.path())
          .with_offset(r.offset);
    }
    if (file.direct() &&
        (!aligned(reinterpret_cast<uintptr_t>(r.buf)) || !aligned(r.len) || !aligned(r.offset))) {
      return Status(StatusCode::kInvalidArgument,
                    "O_DIRECT request not aligned to 4096 bytes (buffer, length and offset must "
                    "be; len=" +
                        std::to_string(r.len) + ")")
          .with_path(file.path())
          .with_offset(r.offset);
    }
    auto* base = static_cast<std::byte*>(r.buf);
    const auto index = static_cast<size_t>(&r - requests.data());
    for (uint64_t off = 0; off < r.len; off += request_bytes) {
      uint64_t n = std::min(request_bytes, r.len - off);
      pieces.push_back(Piece{base + off, n, r.offset + off, index});
    }
  }
  return pieces;
}

Status read_stream_in_batches(IoEngine& engine, ReadStream& stream, Duration timeout,
                              size_t batch) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::optional<StreamRequest> carried;  // the first request of the next batch (another file)
  std::vector<StreamRequest> taken;
  std::vector<IoRequest> reqs;
  for (;;) {
    taken.clear();
    if (carried) taken.push_back(*std::exchange(carried, std::nullopt));
    while (taken.size() < std::max<size_t>(batch, 1)) {
      StreamRequest r;
      RESILIENT_ASSIGN_OR_RETURN(bool more, stream.next(r));
      if (!more) break;
      if (!taken.empty() && r.file != taken.front().file) {
        carried = r;
        break;
      }
      taken.push_back(r);
    }
    if (taken.empty()) return ok_status();
    reqs.clear();
    for (const auto& r : taken) reqs.push_back(IoRequest{r.buf, r.len, r.offset});
    const auto left =
        std::chrono::duration_cast<Duration>(deadline - std::chrono::steady_clock::now());
    if (left <= Duration::zero()) {
      return Status(StatusCode::kTimeout, "read did not finish in time")
          .with_path(taken.front().file->path());
    }
    RESILIENT_RETURN_IF_ERROR(engine.read(*taken.front().file, reqs, left,
                                          [&](size_t i) { return stream.done(taken[i].tag); }));
  }
}

RequestCompletion::RequestCompletion(std::span<const Piece> pieces, size_t requests)
    : left_(requests, 0) {
  for (const Piece& p : pieces) ++left_[p.request];
  for (size_t r = 0; r < requests; ++r) {
    if (left_[r] == 0) ready_.push_back(r);  // nothing to transfer: complete from the start
  }
}

bool RequestCompletion::piece_done(const Piece& p) {
  if (--left_[p.request] != 0) return false;
  ready_.push_back(p.request);
  return true;
}

std::span<const size_t> RequestCompletion::take() {
  std::span<const size_t> out(ready_.data() + next_, ready_.size() - next_);
  next_ = ready_.size();
  return out;
}

Status RequestCompletion::run(const ReadDone& done) {
  for (size_t r : take()) {
    if (done) RESILIENT_RETURN_IF_ERROR(done(r));
  }
  return ok_status();
}

Status transfer_error(Direction dir, const File& file, int err, uint64_t offset) {
  return Status::from_errno(err, direction_name(dir), file.path()).with_offset(offset);
}

Next apply_result(Direction dir, const File& file, Piece& piece, int64_t res, Status& error) {
  const uint64_t at = piece.offset + piece.done;
  if (res == -EAGAIN || res == -EINTR) return Next::kResubmit;
  if (res < 0) {
    error = transfer_error(dir, file, static_cast<int>(-res), at);
    return Next::kFail;
  }
  const uint64_t remaining = piece.len - piece.done;
  const uint64_t got = std::min<uint64_t>(static_cast<uint64_t>(res), remaining);
  if (dir == Direction::kRead) {
    // A read of 0 bytes is end of file. On a direct file a short read that leaves the position
    // unaligned is also end of file (the remainder could not even be requested).
    if (got == 0 || (got < remaining && file.direct() && !aligned(at + got))) {
      error = Status(StatusCode::kCorrupt,
                     "truncated: end of file at " + std::to_string(at + got) + " while reading " +
                         std::to_string(piece.len - piece.done) + " bytes at " + std::to_string(at))
                  .with_path(file.path())
                  .with_offset(at + got);
      return Next::kFail;
    }
  } else if (got == 0) {
    if (++piece.zero_progress >= kMaxZeroProgress) {
      error = transfer_error(dir, file, EIO, at).prepend("no progress");
      return Next::kFail;
    }
    return Next::kResubmit;
  }
  piece.zero_progress = 0;
  piece.done += got;
  return piece.done == piece.len ? Next::kDone : Next::kResubmit;
}

}  // namespace resilient::io::detail
