#pragma once
// The fallback engine: a pool of worker threads doing pwrite/pread, used when io_uring is
// unavailable or refused. Same semantics as the io_uring engine (short transfers resubmitted,
// EAGAIN/EINTR retried, the first error wins and stops the batch).

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "io/detail/transfer.hpp"
#include "resilient/io/engine.hpp"

namespace resilient::io::detail {

class ThreadEngine final : public IoEngine {
 public:
  explicit ThreadEngine(const IoOptions& options);
  ~ThreadEngine() override;

  const char* name() const override { return "threads"; }
  Status write(const File& file, std::span<const IoRequest> requests, Duration timeout) override;
  using IoEngine::read;
  Status read(const File& file, std::span<const IoRequest> requests, Duration timeout,
              const ReadDone& done) override;
  Status read_stream(ReadStream& stream, Duration timeout) override {
    return read_stream_in_batches(*this, stream, timeout,
                                  static_cast<size_t>(std::max(options_.queue_depth, 1)));
  }

 private:
  struct Batch;
  Status run(Direction dir, const File& file, std::span<const IoRequest> requests, Duration timeout,
             const ReadDone& done);
  void worker_loop();
  void work_on(Batch& batch);

  IoOptions options_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::shared_ptr<Batch> batch_;  // the batch being worked on, if any
  uint64_t generation_ = 0;       // bumped per batch so idle workers notice a new one
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace resilient::io::detail
