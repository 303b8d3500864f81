#include "io/detail/thread_engine.hpp"

#include <atomic>
#include <cerrno>

#include "resilient/common/thread_pool.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::io::detail {

// One write() or read() call. Workers claim pieces with an atomic index; the caller waits until
// every piece is finished or skipped, so no worker touches a buffer after the call returns.
struct ThreadEngine::Batch {
  Direction dir;
  const File* file;
  std::vector<Piece> pieces;
  std::atomic<size_t> next{0};
  std::atomic<bool> cancelled{false};
  std::mutex mu;
  std::condition_variable done_cv;
  size_t finished = 0;  // guarded by mu
  Status error;         // first error, guarded by mu
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
  return run(Direction::kWrite, file, requests, timeout);
}

Status ThreadEngine::read(const File& file, std::span<const IoRequest> requests, Duration timeout) {
  return run(Direction::kRead, file, requests, timeout);
}

Status ThreadEngine::run(Direction dir, const File& file, std::span<const IoRequest> requests,
                         Duration timeout) {
  if (!file.is_open()) return Status(StatusCode::kInvalidArgument, "I/O on a closed file");
  auto batch = std::make_shared<Batch>();
  batch->dir = dir;
  batch->file = &file;
  RESILIENT_ASSIGN_OR_RETURN(batch->pieces, split_requests(file, requests, options_.request_bytes));
  if (batch->pieces.empty()) return ok_status();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch_ = batch;
    ++generation_;
  }
  work_cv_.notify_all();

  const size_t total = batch->pieces.size();
  bool timed_out = false;
  {
    std::unique_lock<std::mutex> lock(batch->mu);
    if (!batch->done_cv.wait_until(lock, deadline, [&] { return batch->finished == total; })) {
      timed_out = true;
      batch->cancelled.store(true);
      batch->done_cv.wait(lock, [&] { return batch->finished == total; });  // drain
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch_.reset();
  }
  std::lock_guard<std::mutex> lock(batch->mu);
  if (!batch->error.ok()) return batch->error;
  if (timed_out) {
    return Status(StatusCode::kTimeout, std::string(direction_name(dir)) +
                                            " did not finish within " +
                                            std::to_string(to_seconds(timeout)) + " s")
        .with_path(file.path());
  }
  return ok_status();
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
    if (++b.finished == b.pieces.size()) b.done_cv.notify_all();
  }
}

}  // namespace resilient::io::detail
