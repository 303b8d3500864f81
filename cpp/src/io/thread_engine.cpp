#include "io/detail/thread_engine.hpp"

#include <atomic>
#include <cerrno>
#include <optional>

#include "resilient/common/thread_pool.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::io::detail {

// One write() or read() call. Workers claim pieces with an atomic index; the caller waits until
// every piece is finished or skipped, so no worker touches a buffer after the call returns.
// Completed requests are handed to the caller, which runs their ReadDone callbacks.
struct ThreadEngine::Batch {
  Direction dir;
  const File* file;
  std::vector<Piece> pieces;
  std::atomic<size_t> next{0};
  std::atomic<bool> cancelled{false};
  std::mutex mu;
  std::condition_variable done_cv;
  size_t finished = 0;                          // guarded by mu
  Status error;                                 // first error, guarded by mu
  std::optional<RequestCompletion> completion;  // guarded by mu
};

ThreadEngine::ThreadEngine(const IoOptions& options) : options_(options) {
  int n = options_.threads < 1 ? 1 : options_.threads;
  workers_.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    workers_.emplace_back([this] {
      set_thread_name("rs-io");
      worker_loop();
    });
}

ThreadEngine::~ThreadEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

Status ThreadEngine::write(const File& file, std::span<const IoRequest> requests,
                           Duration timeout) {
  return run(Direction::kWrite, file, requests, timeout, ReadDone());
}

Status ThreadEngine::read(const File& file, std::span<const IoRequest> requests, Duration timeout,
                          const ReadDone& done) {
  return run(Direction::kRead, file, requests, timeout, done);
}

Status ThreadEngine::run(Direction dir, const File& file, std::span<const IoRequest> requests,
                         Duration timeout, const ReadDone& done) {
  if (!file.is_open()) return Status(StatusCode::kInvalidArgument, "I/O on a closed file");
  auto batch = std::make_shared<Batch>();
  batch->dir = dir;
  batch->file = &file;
  RESILIENT_ASSIGN_OR_RETURN(batch->pieces, split_requests(file, requests, options_.request_bytes));
  batch->completion.emplace(batch->pieces, requests.size());
  if (batch->pieces.empty()) return batch->completion->run(done);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch_ = batch;
    ++generation_;
  }
  work_cv_.notify_all();

  const size_t total = batch->pieces.size();
  bool timed_out = false;
  Status callback_error;
  {
    std::unique_lock<std::mutex> lock(batch->mu);
    // Completed requests get their callbacks here, outside the lock, while the workers go on.
    auto wake = [&] {
      return batch->finished == total ||
             (done && callback_error.ok() && !batch->cancelled && batch->completion->pending());
    };
    while (!timed_out && batch->finished < total) {
      if (!batch->done_cv.wait_until(lock, deadline, wake)) {
        timed_out = true;
        break;
      }
      if (done && batch->completion->pending() && callback_error.ok() && !batch->cancelled) {
        const auto taken = batch->completion->take();
        std::vector<size_t> ready(taken.begin(), taken.end());  // ready_ may grow meanwhile
        lock.unlock();
        for (size_t r : ready) {
          callback_error = done(r);
          if (!callback_error.ok()) break;
        }
        lock.lock();
        if (!callback_error.ok()) batch->cancelled.store(true);
      }
    }
    if (timed_out) batch->cancelled.store(true);
    batch->done_cv.wait(lock, [&] { return batch->finished == total; });  // drain
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch_.reset();
  }
  // Every worker is done with the batch: no lock needed from here on.
  if (!batch->error.ok()) return batch->error;
  if (!callback_error.ok()) return callback_error;
  if (timed_out) {
    return Status(StatusCode::kTimeout, std::string(direction_name(dir)) +
                                            " did not finish within " +
                                            std::to_string(to_seconds(timeout)) + " s")
        .with_path(file.path());
  }
  return batch->completion->run(done);  // the last completions
}

void ThreadEngine::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    std::shared_ptr<Batch> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stopping_ || (batch_ && generation_ != seen); });
      if (stopping_) return;
      seen = generation_;
      batch = batch_;
    }
    work_on(*batch);
  }
}

void ThreadEngine::work_on(Batch& b) {
  for (;;) {
    size_t i = b.next.fetch_add(1);
    if (i >= b.pieces.size()) return;
    // Only now, with a piece claimed, is the caller still waiting and the file alive: a worker
    // that wakes after the others finished the batch must not touch it (TSan found the read
    // of a File the caller had already closed).
    const int fd = b.file->fd();
    Piece& p = b.pieces[i];
    Status error;
    while (!b.cancelled.load(std::memory_order_relaxed)) {
      const uint64_t at = p.offset + p.done;
      ssize_t n = b.dir == Direction::kWrite
                      ? sys::pwrite(fd, p.buf + p.done, p.len - p.done, static_cast<off_t>(at))
                      : sys::pread(fd, p.buf + p.done, p.len - p.done, static_cast<off_t>(at));
      int64_t res = n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
      Next next = apply_result(b.dir, *b.file, p, res, error);
      if (next == Next::kDone) break;
      if (next == Next::kFail) {
        b.cancelled.store(true);
        break;
      }
      if (res == -EAGAIN) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    std::lock_guard<std::mutex> lock(b.mu);
    if (!error.ok() && b.error.ok()) b.error = std::move(error);
    const bool request_done = error.ok() && p.done == p.len && b.completion->piece_done(p);
    if (++b.finished == b.pieces.size() || request_done) b.done_cv.notify_all();
  }
}

}  // namespace resilient::io::detail
