#include "io/detail/uring_engine.hpp"

#include <cerrno>
#include <cstring>
#include <deque>

#include "resilient/common/logging.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::io::detail {
namespace {

__kernel_timespec to_timespec(Duration d) {
  if (d.count() < 0) d = Duration::zero();
  __kernel_timespec ts{};
  ts.tv_sec = static_cast<long long>(d.count() / 1000000000);
  ts.tv_nsec = static_cast<long long>(d.count() % 1000000000);
  return ts;
}

RingInit g_ring_init = nullptr;

}  // namespace

void set_ring_init_for_testing(RingInit init) { g_ring_init = init; }

Result<std::unique_ptr<UringEngine>> UringEngine::create(const IoOptions& options) {
  std::unique_ptr<UringEngine> engine(new UringEngine(options));
  RingInit init = g_ring_init != nullptr ? g_ring_init : &io_uring_queue_init;
  int rc = init(static_cast<unsigned>(options.queue_depth), &engine->ring_, 0);
  if (rc < 0) {
    engine->ring_.ring_fd = -1;
    return Status::from_errno(-rc, "io_uring_queue_init").with_errno(-rc);
  }
  return engine;
}

UringEngine::~UringEngine() {
  if (ring_.ring_fd >= 0) io_uring_queue_exit(&ring_);
}

Status UringEngine::register_buffers(std::span<const iovec> buffers) {
  if (!registered_.empty()) {
    io_uring_unregister_buffers(&ring_);
    registered_.clear();
  }
  if (buffers.empty()) return ok_status();
  int rc = io_uring_register_buffers(&ring_, buffers.data(), static_cast<unsigned>(buffers.size()));
  if (rc < 0) {
    log_once("io.uring_register_failed", LogLevel::kInfo,
             std::string("io_uring buffer registration refused (") + std::strerror(-rc) +
                 "); using unregistered buffers");
    return Status::from_errno(-rc, "io_uring_register_buffers").with_errno(-rc);
  }
  registered_.assign(buffers.begin(), buffers.end());
  return ok_status();
}

int UringEngine::fixed_index(const std::byte* p, uint64_t n) const {
  for (size_t i = 0; i < registered_.size(); ++i) {
    auto* base = static_cast<const std::byte*>(registered_[i].iov_base);
    if (p >= base && p + n <= base + registered_[i].iov_len) return static_cast<int>(i);
  }
  return -1;
}

Status UringEngine::write(const File& file, std::span<const IoRequest> requests, Duration timeout) {
  return run(Direction::kWrite, file, requests, timeout, ReadDone());
}

Status UringEngine::read(const File& file, std::span<const IoRequest> requests, Duration timeout,
                         const ReadDone& done) {
  return run(Direction::kRead, file, requests, timeout, done);
}

Status UringEngine::run(Direction dir, const File& file, std::span<const IoRequest> requests,
                        Duration timeout, const ReadDone& done) {
  if (!file.is_open()) return Status(StatusCode::kInvalidArgument, "I/O on a closed file");
  RESILIENT_ASSIGN_OR_RETURN(auto pieces, split_requests(file, requests, options_.request_bytes));
  RequestCompletion requests_done(pieces, requests.size());
  if (pieces.empty()) return requests_done.run(done);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const int fd = file.fd();
  const FileOp op = dir == Direction::kWrite ? FileOp::kWrite : FileOp::kRead;

  std::deque<size_t> ready;  // pieces waiting for a submission (new, or to resubmit)
  size_t next_new = 0;
  size_t in_flight = 0;
  size_t completed = 0;
  Status error;
  bool timed_out = false;

  enum class Prepared { kQueued, kRetry, kFailed, kSqFull };
  // Queues one SQE for piece i; a hook-injected errno completes it at once instead.
  auto prepare = [&](size_t i) -> Prepared {
    Piece& p = pieces[i];
    uint64_t n = p.len - p.done;
    int hooked = file_hook(op, fd);
    if (hooked > 0) {
      return apply_result(dir, file, p, -hooked, error) == Next::kFail ? Prepared::kFailed
                                                                       : Prepared::kRetry;
    }
    if (hooked < 0) n = std::min<uint64_t>(n, static_cast<uint64_t>(-hooked));
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return Prepared::kSqFull;
    std::byte* buf = p.buf + p.done;
    const uint64_t at = p.offset + p.done;
    const int fixed = fixed_index(buf, n);
    const unsigned len = static_cast<unsigned>(n);
    if (dir == Direction::kWrite) {
      if (fixed >= 0)
        io_uring_prep_write_fixed(sqe, fd, buf, len, at, fixed);
      else
        io_uring_prep_write(sqe, fd, buf, len, at);
    } else {
      if (fixed >= 0)
        io_uring_prep_read_fixed(sqe, fd, buf, len, at, fixed);
      else
        io_uring_prep_read(sqe, fd, buf, len, at);
    }
    if (fixed >= 0) ++fixed_submissions_;
    io_uring_sqe_set_data64(sqe, i);
    ++in_flight;
    return Prepared::kQueued;
  };

  const size_t depth = static_cast<size_t>(options_.queue_depth);
  while (completed < pieces.size()) {
    // Fill the queue up to the depth unless stopping.
    while (error.ok() && !timed_out && in_flight < depth) {
      size_t i;
      if (!ready.empty()) {
        i = ready.front();
        ready.pop_front();
      } else if (next_new < pieces.size()) {
        i = next_new++;
      } else {
        break;
      }
      Prepared r = prepare(i);
      if (r == Prepared::kSqFull) {
        ready.push_front(i);
        break;
      }
      if (r == Prepared::kRetry) {
        ready.push_back(i);
        if (std::chrono::steady_clock::now() >= deadline) timed_out = true;
      }
    }
    if (in_flight == 0) break;  // finished, failed, or timed out with nothing to drain
    int rc = io_uring_submit(&ring_);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      error = transfer_error(dir, file, -rc, pieces.front().offset).prepend("io_uring_submit");
    }
    // The requests completed so far get their callbacks now, with the queue refilled: the device
    // keeps reading while the caller checks and copies.
    if (error.ok() && !timed_out) error = requests_done.run(done);
    // Wait for one completion; after an error or timeout, drain without a deadline.
    io_uring_cqe* cqe = nullptr;
    int wrc;
    if (error.ok() && !timed_out) {
      __kernel_timespec ts = to_timespec(deadline - std::chrono::steady_clock::now());
      wrc = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
      if (wrc == -ETIME) {
        timed_out = true;
        continue;
      }
    } else {
      wrc = io_uring_wait_cqe(&ring_, &cqe);
    }
    if (wrc == -EINTR || wrc == -EAGAIN) continue;
    if (wrc < 0) {
      // The ring itself failed: nothing more can be reaped safely.
      if (error.ok()) error = transfer_error(dir, file, -wrc, 0).prepend("io_uring_wait_cqe");
      return error;
    }
    // Reap everything that is ready.
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      --in_flight;
      Status piece_error;
      Next next = apply_result(dir, file, pieces[i], cqe->res, piece_error);
      if (next == Next::kDone) {
        ++completed;
        requests_done.piece_done(pieces[i]);
      } else if (next == Next::kResubmit) {
        if (error.ok() && !timed_out) ready.push_back(i);
      } else if (error.ok()) {
        error = std::move(piece_error);
      }
    }
    io_uring_cq_advance(&ring_, seen);
  }
  if (!error.ok()) return error;
  if (timed_out || completed < pieces.size()) {
    return Status(StatusCode::kTimeout, std::string(direction_name(dir)) +
                                            " did not finish within " +
                                            std::to_string(to_seconds(timeout)) + " s")
        .with_path(file.path());
  }
  return requests_done.run(done);  // the last completions
}

}  // namespace resilient::io::detail

namespace resilient::io::detail {

bool UringEngine::prep_read(int fd, std::byte* buf, uint64_t n, uint64_t at, uint64_t data) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) return false;
  const int fixed = fixed_index(buf, n);
  if (fixed >= 0) {
    io_uring_prep_read_fixed(sqe, fd, buf, static_cast<unsigned>(n), at, fixed);
    ++fixed_submissions_;
  } else {
    io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(n), at);
  }
  io_uring_sqe_set_data64(sqe, data);
  return true;
}

// The loop of run(), with requests taken from the stream as the queue has room and the pieces
// of finished requests' slots reused.
Status UringEngine::read_stream(ReadStream& stream, Duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  struct Slot {
    Piece piece;
    const File* file;
  };
  std::vector<Slot> slots;            // pieces of the requests being read, by user data
  std::vector<size_t> free_slots;     // slots to reuse
  std::vector<size_t> left;           // pieces not done, per request slot
  std::vector<uint64_t> tags;         // per request slot
  std::vector<size_t> free_requests;  // request slots to reuse
  std::deque<size_t> ready;           // piece slots waiting for a submission (new, or to resubmit)
  std::vector<uint64_t> finished;     // tags of requests read
  size_t in_flight = 0;
  size_t unsubmitted = 0;  // prepared SQEs not yet submitted
  Status error;
  bool timed_out = false;

  // Takes the stream's next request into slots and `ready`; false when it has none for now.
  auto take = [&]() -> bool {
    StreamRequest r;
    Result<bool> more = stream.next(r);
    if (!more.ok()) {
      error = more.status();
      return false;
    }
    if (!*more) return false;
    const IoRequest one{r.buf, r.len, r.offset};
    auto pieces = split_requests(*r.file, {&one, 1}, options_.request_bytes);
    if (!pieces.ok()) {
      error = pieces.status();
      return false;
    }
    size_t req;
    if (free_requests.empty()) {
      req = left.size();
      left.push_back(0);
      tags.push_back(0);
    } else {
      req = free_requests.back();
      free_requests.pop_back();
    }
    left[req] = pieces->size();
    tags[req] = r.tag;
    if (pieces->empty()) {  // nothing to read: done at once
      finished.push_back(r.tag);
      free_requests.push_back(req);
      return true;
    }
    for (Piece p : *pieces) {
      p.request = req;
      size_t i;
      if (free_slots.empty()) {
        i = slots.size();
        slots.push_back(Slot{p, r.file});
      } else {
        i = free_slots.back();
        free_slots.pop_back();
        slots[i] = Slot{p, r.file};
      }
      ready.push_back(i);
    }
    return true;
  };
  size_t next_done = 0;  // finished[next_done...] are due

  const size_t depth = static_cast<size_t>(options_.queue_depth);
  for (;;) {
    while (error.ok() && !timed_out && in_flight < depth) {
      if (ready.empty() && !take()) break;
      if (ready.empty()) continue;  // a request with nothing to read
      const size_t i = ready.front();
      Slot& s = slots[i];
      Piece& p = s.piece;
      uint64_t n = p.len - p.done;
      const int hooked = file_hook(FileOp::kRead, s.file->fd());
      if (hooked > 0) {  // an injected errno completes the piece at once
        if (apply_result(Direction::kRead, *s.file, p, -hooked, error) == Next::kFail) break;
        ready.push_back(ready.front());  // retried (EAGAIN, EINTR)
        ready.pop_front();
        if (std::chrono::steady_clock::now() >= deadline) timed_out = true;
        continue;
      }
      if (hooked < 0) n = std::min<uint64_t>(n, static_cast<uint64_t>(-hooked));
      if (!prep_read(s.file->fd(), p.buf + p.done, n, p.offset + p.done, i)) break;  // SQ full
      ready.pop_front();
      ++in_flight;
      ++unsubmitted;
    }
    if (unsubmitted > 0) {
      int rc = io_uring_submit(&ring_);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && error.ok())
        error = transfer_error(Direction::kRead, *slots[0].file, -rc, 0).prepend("io_uring_submit");
      if (rc > 0) unsubmitted -= std::min<size_t>(unsubmitted, static_cast<size_t>(rc));
    }
    // One finished request at a time gets its done(), the queue refilled before each: the buffer
    // a done() frees is read into while the next finished request is checked and copied.
    if (next_done < finished.size() && error.ok() && !timed_out) {
      error = stream.done(finished[next_done++]);
      continue;
    }
    finished.clear();  // all had their done(), or an error stopped the stream
    next_done = 0;
    if (in_flight == 0) break;  // finished, failed, or timed out with nothing to drain
    io_uring_cqe* cqe = nullptr;
    int wrc;
    if (error.ok() && !timed_out) {
      __kernel_timespec ts = to_timespec(deadline - std::chrono::steady_clock::now());
      wrc = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
      if (wrc == -ETIME) {
        timed_out = true;
        continue;
      }
    } else {
      wrc = io_uring_wait_cqe(&ring_, &cqe);  // drain what is in flight
    }
    if (wrc == -EINTR || wrc == -EAGAIN) continue;
    if (wrc < 0) {
      if (error.ok())
        error =
            transfer_error(Direction::kRead, *slots[0].file, -wrc, 0).prepend("io_uring_wait_cqe");
      return error;
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      const auto i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      --in_flight;
      Slot& s = slots[i];
      Status piece_error;
      Next next = apply_result(Direction::kRead, *s.file, s.piece, cqe->res, piece_error);
      if (next == Next::kDone) {
        free_slots.push_back(i);
        if (--left[s.piece.request] == 0) {
          finished.push_back(tags[s.piece.request]);
          free_requests.push_back(s.piece.request);
        }
      } else if (next == Next::kResubmit) {
        if (error.ok() && !timed_out) ready.push_back(i);
      } else if (error.ok()) {
        error = std::move(piece_error);
      }
    }
    io_uring_cq_advance(&ring_, seen);
  }
  if (!error.ok()) return error;
  if (timed_out) {
    return Status(StatusCode::kTimeout, "streaming read did not finish within " +
                                            std::to_string(to_seconds(timeout)) + " s");
  }
  return ok_status();
}

}  // namespace resilient::io::detail
