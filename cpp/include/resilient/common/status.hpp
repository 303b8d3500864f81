#pragma once
// Status and Result<T>: errors as values where failure is expected (I/O, peers, corrupt data).
// Programmer mistakes use RESILIENT_CHECK, which throws std::logic_error.

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace resilient {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,  // bad input from the caller (shape mismatch, unknown setting value)
  kNotFound,         // a file, step, tensor or peer that does not exist
  kAlreadyExists,
  kCorrupt,          // checksum mismatch, truncated or malformed file
  kVersionMismatch,  // a format version this build cannot read
  kIoError,          // an OS error; errno() says which
  kNoSpace,          // ENOSPC / EDQUOT
  kTimeout,          // a deadline passed
  kCancelled,
  kUnavailable,  // a peer or feature (CUDA, NCCL, io_uring) is absent or gone
  kFailedPrecondition,
  kResourceExhausted,  // a budget (memory pool, queue) is exhausted
  kInternal,
};

/// Name of a status code, e.g. "Corrupt".
const char* status_code_name(StatusCode code);

/// An error value: code, message, and where known the errno, file path and byte offset.
/// Cheap to copy when ok. Thread-compatible.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }
  /// An OS error: code kIoError (kNoSpace for ENOSPC/EDQUOT), message "<what>: <strerror>".
  static Status from_errno(int err, const std::string& what, const std::string& path = {});

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  int sys_errno() const { return errno_; }
  const std::string& path() const { return path_; }
  std::optional<uint64_t> offset() const { return offset_; }

  Status& with_errno(int e) {
    errno_ = e;
    return *this;
  }
  Status& with_path(std::string p) {
    path_ = std::move(p);
    return *this;
  }
  Status& with_offset(uint64_t o) {
    offset_ = o;
    return *this;
  }
  /// Prefixes the message with context ("saving step 7: ...").
  Status& prepend(const std::string& context);

  /// "Corrupt: checksum mismatch [file=/x/rank-0.data offset=4096 errno=5]"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int errno_ = 0;
  std::string path_;
  std::optional<uint64_t> offset_;
};

inline Status ok_status() { return Status(); }

/// A value or an error Status. Accessing value() of an error is a programmer error (throws).
template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(runtime/explicit)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(runtime/explicit)
    if (std::get<Status>(v_).ok()) throw std::logic_error("Result constructed from ok Status");
  }
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    check();
    return std::get<T>(v_);
  }
  const T& value() const& {
    check();
    return std::get<T>(v_);
  }
  T&& value() && {
    check();
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  void check() const {
    if (!ok()) throw std::logic_error("Result::value() on error: " + status().to_string());
  }
  std::variant<T, Status> v_;
};

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const char* cond,
                               const std::string& msg);
}  // namespace detail

}  // namespace resilient

#define RESILIENT_CONCAT_INNER_(a, b) a##b
#define RESILIENT_CONCAT_(a, b) RESILIENT_CONCAT_INNER_(a, b)

/// Returns the Status from the enclosing function if `expr` is an error.
#define RESILIENT_RETURN_IF_ERROR(expr) \
  do {                                  \
    ::resilient::Status _st = (expr);   \
    if (!_st.ok()) return _st;          \
  } while (0)

#define RESILIENT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return tmp.status();                    \
  lhs = std::move(tmp).value()

/// `RESILIENT_ASSIGN_OR_RETURN(auto x, make_x());` declares x or returns the error.
#define RESILIENT_ASSIGN_OR_RETURN(lhs, expr) \
  RESILIENT_ASSIGN_OR_RETURN_IMPL_(RESILIENT_CONCAT_(_res_, __LINE__), lhs, expr)

/// Programmer-error check: throws std::logic_error; the message is built only on failure.
#define RESILIENT_CHECK(cond, msg)                                             \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::ostringstream _os;                                                  \
      _os << msg;                                                              \
      ::resilient::detail::check_failed(__FILE__, __LINE__, #cond, _os.str()); \
    }                                                                          \
  } while (0)
