#include "resilient/common/status.hpp"

#include <cerrno>
#include <cstring>

namespace resilient {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kCorrupt:
      return "Corrupt";
    case StatusCode::kVersionMismatch:
      return "VersionMismatch";
    case StatusCode::kIoError:
      return "IoError";
    case StatusCode::kNoSpace:
      return "NoSpace";
    case StatusCode::kTimeout:
      return "Timeout";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

Status Status::from_errno(int err, const std::string& what, const std::string& path) {
  StatusCode code = (err == ENOSPC || err == EDQUOT) ? StatusCode::kNoSpace
                    : (err == ENOENT)                ? StatusCode::kNotFound
                    : (err == ETIMEDOUT)             ? StatusCode::kTimeout
                                                     : StatusCode::kIoError;
  std::string msg = what + ": " + std::strerror(err);
  if (!path.empty()) msg += " (" + path + ")";
  Status s(code, std::move(msg));
  s.with_errno(err);
  if (!path.empty()) s.with_path(path);
  return s;
}

Status& Status::prepend(const std::string& context) {
  message_ = context + ": " + message_;
  return *this;
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  std::string s = std::string(status_code_name(code_)) + ": " + message_;
  std::string extra;
  if (!path_.empty()) extra += "file=" + path_;
  if (offset_)
    extra += (extra.empty() ? "" : " ") + std::string("offset=") + std::to_string(*offset_);
  if (errno_) extra += (extra.empty() ? "" : " ") + std::string("errno=") + std::to_string(errno_);
  if (!extra.empty()) s += " [" + extra + "]";
  return s;
}

namespace detail {
void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  throw std::logic_error(std::string(file) + ":" + std::to_string(line) +
                         ": check failed: " + cond + (msg.empty() ? "" : ": " + msg));
}
}  // namespace detail

}  // namespace resilient
