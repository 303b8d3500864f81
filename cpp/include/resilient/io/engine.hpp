#pragma once
// Batched file I/O engines: io_uring (liburing) with several large requests in flight, and a
// pwrite/pread thread pool used only when io_uring is unavailable or refused. The choice is made
// at run time by create() and logged once.

#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "resilient/common/clock.hpp"
#include "resilient/common/config.hpp"
#include "resilient/common/status.hpp"
#include "resilient/io/file.hpp"

namespace resilient::io {

/// I/O settings. Defaults come from the environment (see docs/SETTINGS.md).
struct IoOptions {
  Feature uring = Feature::kAuto;        // RESILIENT_IO_URING
  Feature direct = Feature::kAuto;       // RESILIENT_O_DIRECT
  uint64_t request_bytes = 16ull << 20;  // RESILIENT_IO_REQUEST_BYTES: max bytes per request
  int queue_depth = 8;                   // RESILIENT_IO_QUEUE_DEPTH: requests in flight
  int threads = 4;                       // RESILIENT_IO_THREADS: pwrite fallback pool size

  /// Defaults with the RESILIENT_IO_* / RESILIENT_O_DIRECT overrides, then validate()d.
  static Result<IoOptions> from_env();
  Status validate() const;
};

/// One transfer: `len` bytes between `buf` and the file at `offset`. On O_DIRECT files, buf,
/// len and offset must be multiples of kDirectAlignment (kInvalidArgument otherwise).
struct IoRequest {
  void* buf;
  uint64_t len;
  uint64_t offset;
};

/// One request of a streaming read (IoEngine::read_stream): `len` bytes of `file` at `offset`
/// into `buf`, under IoRequest's rules, and the reader's `tag` for it. `file` must stay open
/// until the request is done.
struct StreamRequest {
  const File* file = nullptr;
  void* buf = nullptr;
  uint64_t len = 0;
  uint64_t offset = 0;
  uint64_t tag = 0;
};

/// The reader's side of a streaming read. Both calls run on the thread that called read_stream().
class ReadStream {
 public:
  virtual ~ReadStream() = default;
  /// The next request to read, in `out` (true), or none for now (false): the engine asks again
  /// after the next completion, and the stream ends when there is none and none is in flight.
  /// An error stops the stream.
  virtual Result<bool> next(StreamRequest& out) = 0;
  /// Every byte of the request tagged `tag` is in its buffer. An error stops the stream.
  virtual Status done(uint64_t tag) = 0;
};

/// Called on the reading thread once every byte of `requests[index]` is in its buffer, while the
/// engine keeps the call's later requests in flight (so the caller checks or copies one request's
/// bytes while the next ones are read). A non-OK status stops the call as a failed transfer does:
/// what is in flight is drained, no further callback runs, and read() returns that status.
using ReadDone = std::function<Status(size_t index)>;

/// A batch I/O engine. One instance is used by one thread at a time; create one per thread.
class IoEngine {
 public:
  virtual ~IoEngine() = default;

  /// io_uring when allowed and working, else the thread pool (logged once). With
  /// options.uring == kOn, an unusable io_uring is an error (kUnavailable).
  static Result<std::unique_ptr<IoEngine>> create(const IoOptions& options);

  /// "io_uring" or "threads".
  virtual const char* name() const = 0;

  /// Writes every request completely: splits into request_bytes pieces, keeps up to queue_depth
  /// in flight, resubmits the remainder of short transfers and retries EAGAIN/EINTR. Returns when
  /// all are done or at the first error (with path and offset); on error the file content is
  /// unspecified. kTimeout if not done within `timeout` (in-flight requests are drained first).
  virtual Status write(const File& file, std::span<const IoRequest> requests, Duration timeout) = 0;

  /// Reads every request completely, with the same rules. Reading past end of file is kCorrupt
  /// ("truncated"), naming the file and offset.
  Status read(const File& file, std::span<const IoRequest> requests, Duration timeout) {
    return read(file, requests, timeout, ReadDone());
  }
  /// As above, calling `done(i)` (when given) as soon as request i is complete, in completion
  /// order; requests of length 0 complete first. Once read() returns OK, `done` ran for every
  /// request.
  virtual Status read(const File& file, std::span<const IoRequest> requests, Duration timeout,
                      const ReadDone& done) = 0;

  /// Reads what `stream` supplies while it supplies it: whenever the queue has room it asks
  /// next() for a request, and it calls done() for each request whose bytes are all in, after
  /// refilling the queue, so the device reads the next requests while the caller checks and
  /// copies; it returns once next() has nothing and nothing is in flight. The rules of read()
  /// apply to each request; the first error (a transfer's, next()'s or done()'s) stops the
  /// stream: what is in flight is drained and no further done() runs. `timeout` bounds the
  /// whole call (kTimeout). The thread engine reads the stream in batches of up to queue_depth
  /// requests, one file at a time.
  virtual Status read_stream(ReadStream& stream, Duration timeout) = 0;

  /// Registers long-lived buffers (e.g. the host pool's slabs) as io_uring fixed buffers, which
  /// saves per-request page pinning. Optional: the thread engine ignores it. Requests whose
  /// buffer lies inside a registered range use the fixed-buffer opcodes.
  virtual Status register_buffers(std::span<const iovec> buffers) { return ok_status(); }
};

}  // namespace resilient::io
