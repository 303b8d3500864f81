#include "resilient/io/engine.hpp"

#include <cerrno>
#include <cstring>

#include "io/detail/thread_engine.hpp"
#include "io/detail/uring_engine.hpp"
#include "resilient/common/logging.hpp"

namespace resilient::io {

Result<IoOptions> IoOptions::from_env() {
  IoOptions o;
  RESILIENT_ASSIGN_OR_RETURN(o.uring, env_value("RESILIENT_IO_URING", o.uring, parse_feature));
  RESILIENT_ASSIGN_OR_RETURN(o.direct, env_value("RESILIENT_O_DIRECT", o.direct, parse_feature));
  RESILIENT_ASSIGN_OR_RETURN(o.request_bytes,
                             env_value("RESILIENT_IO_REQUEST_BYTES", o.request_bytes, parse_bytes));
  RESILIENT_ASSIGN_OR_RETURN(
      int64_t depth, env_value<int64_t>("RESILIENT_IO_QUEUE_DEPTH", o.queue_depth, parse_int));
  RESILIENT_ASSIGN_OR_RETURN(int64_t threads,
                             env_value<int64_t>("RESILIENT_IO_THREADS", o.threads, parse_int));
  if (depth < 0 || depth > 1 << 20 || threads < 0 || threads > 1 << 20) {
    return Status(StatusCode::kInvalidArgument,
                  "RESILIENT_IO_QUEUE_DEPTH / RESILIENT_IO_THREADS out of range");
  }
  o.queue_depth = static_cast<int>(depth);
  o.threads = static_cast<int>(threads);
  RESILIENT_RETURN_IF_ERROR(o.validate());
  return o;
}

Status IoOptions::validate() const {
  auto bad = [](const std::string& what) {
    return Status(StatusCode::kInvalidArgument, "invalid I/O setting: " + what);
  };
  if (request_bytes == 0 || request_bytes % kDirectAlignment != 0) {
    return bad(
        "request_bytes (RESILIENT_IO_REQUEST_BYTES) must be a positive multiple of 4096, "
        "got " +
        std::to_string(request_bytes));
  }
  if (request_bytes > (1ull << 30)) {
    return bad("request_bytes (RESILIENT_IO_REQUEST_BYTES) must be at most 1 GiB, got " +
               std::to_string(request_bytes));
  }
  if (queue_depth < 1 || queue_depth > 4096) {
    return bad("queue_depth (RESILIENT_IO_QUEUE_DEPTH) must be in [1, 4096], got " +
               std::to_string(queue_depth));
  }
  if (threads < 1 || threads > 256) {
    return bad("threads (RESILIENT_IO_THREADS) must be in [1, 256], got " +
               std::to_string(threads));
  }
  return ok_status();
}

Result<std::unique_ptr<IoEngine>> IoEngine::create(const IoOptions& options) {
  RESILIENT_RETURN_IF_ERROR(options.validate());
  if (options.uring != Feature::kOff) {
    auto uring = detail::UringEngine::create(options);
    if (uring.ok()) return std::unique_ptr<IoEngine>(std::move(uring).value());
    const int err = uring.status().sys_errno();
    if (options.uring == Feature::kOn) {
      return Status(StatusCode::kUnavailable,
                    std::string("io_uring unavailable and RESILIENT_IO_URING=on: ") +
                        std::strerror(err))
          .with_errno(err);
    }
    log_once("io.uring_fallback", LogLevel::kWarn,
             std::string("io_uring unavailable (") + std::strerror(err) +
                 "); using the pwrite/pread thread engine");
  }
  return std::unique_ptr<IoEngine>(new detail::ThreadEngine(options));
}

}  // namespace resilient::io
