#pragma once
// The io_uring engine (liburing): keeps up to queue_depth requests of at most request_bytes in
// flight, resubmits the remainder of short transfers, retries -EAGAIN/-EINTR, and uses the
// fixed-buffer opcodes for requests inside registered buffers. Before each submission it asks
// file_hook(kWrite/kRead, fd) so tests can inject errors and short transfers.

#include <liburing.h>

#include <vector>

#include "io/detail/transfer.hpp"
#include "resilient/io/engine.hpp"

namespace resilient::io::detail {

/// The ring constructor (io_uring_queue_init). Tests replace it to simulate a kernel or a
/// seccomp policy that refuses io_uring; nullptr restores the real one. Not thread-safe.
using RingInit = int (*)(unsigned entries, io_uring* ring, unsigned flags);
void set_ring_init_for_testing(RingInit init);

class UringEngine final : public IoEngine {
 public:
  /// Sets up a ring of options.queue_depth entries; the error is the negated io_uring_queue_init
  /// result as a Status (errno set).
  static Result<std::unique_ptr<UringEngine>> create(const IoOptions& options);
  ~UringEngine() override;

  const char* name() const override { return "io_uring"; }
  Status write(const File& file, std::span<const IoRequest> requests, Duration timeout) override;
  using IoEngine::read;
  Status read(const File& file, std::span<const IoRequest> requests, Duration timeout,
              const ReadDone& done) override;
  Status read_stream(ReadStream& stream, Duration timeout) override;
  Status register_buffers(std::span<const iovec> buffers) override;

  /// Number of submissions that used a fixed buffer (for tests).
  uint64_t fixed_submissions() const { return fixed_submissions_; }

 private:
  explicit UringEngine(const IoOptions& options) : options_(options) {}
  Status run(Direction dir, const File& file, std::span<const IoRequest> requests, Duration timeout,
             const ReadDone& done);
  /// Queues one read SQE for `n` bytes at `at` of `fd` into `buf` with user data `data`; false
  /// when the submission queue is full.
  bool prep_read(int fd, std::byte* buf, uint64_t n, uint64_t at, uint64_t data);
  /// Index of the registered buffer that contains [p, p + n), or -1.
  int fixed_index(const std::byte* p, uint64_t n) const;

  IoOptions options_;
  io_uring ring_{};
  std::vector<iovec> registered_;
  uint64_t fixed_submissions_ = 0;
};

}  // namespace resilient::io::detail
