#include "resilient/io/fault_env.hpp"

#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "resilient/common/config.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::io {
namespace {

constexpr FileOp kAllOps[] = {FileOp::kOpen,     FileOp::kWrite,  FileOp::kRead,  FileOp::kFsync,
                              FileOp::kRename,   FileOp::kUnlink, FileOp::kMkdir, FileOp::kRmdir,
                              FileOp::kTruncate, FileOp::kClose};

struct Installed {
  std::mutex mu;
  std::unique_ptr<ScopedFileHook> hook;
  std::shared_ptr<std::atomic<int64_t>> seen, hits;
};

Installed& installed() {
  static Installed* s = new Installed();  // never destroyed: hooks may run during teardown
  return *s;
}

Result<int> parse_errno(const std::string& text) {
  static const std::pair<const char*, int> kNames[] = {
      {"EIO", EIO},       {"ENOSPC", ENOSPC}, {"EDQUOT", EDQUOT}, {"EROFS", EROFS},
      {"EAGAIN", EAGAIN}, {"EINTR", EINTR},   {"EACCES", EACCES}, {"ENOENT", ENOENT}};
  for (const auto& [name, value] : kNames)
    if (text == name) return value;
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (!text.empty() && end && *end == '\0' && v >= 0) return static_cast<int>(v);
  return Status(StatusCode::kInvalidArgument, "RESILIENT_FAULT_ERRNO: unknown errno " + text);
}

Result<uint32_t> parse_ops(const std::string& text) {
  uint32_t mask = 0;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    std::string name =
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!name.empty()) {
      bool found = false;
      for (FileOp op : kAllOps) {
        if (name == file_op_name(op) || name == "all") {
          mask |= 1u << static_cast<int>(op);
          found = true;
        }
      }
      if (!found)
        return Status(StatusCode::kInvalidArgument, "RESILIENT_FAULT_OPS: unknown op " + name);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return mask;
}

}  // namespace

Result<FaultSpec> fault_spec_from_env() {
  FaultSpec spec;
  auto ops = env_string("RESILIENT_FAULT_OPS");
  if (!ops || ops->empty()) return spec;
  RESILIENT_ASSIGN_OR_RETURN(spec.ops, parse_ops(*ops));
  RESILIENT_ASSIGN_OR_RETURN(spec.error,
                             parse_errno(env_string("RESILIENT_FAULT_ERRNO").value_or("EIO")));
  spec.path_contains = env_string("RESILIENT_FAULT_PATH").value_or("");
  spec.after = env_int("RESILIENT_FAULT_AFTER", 0);
  spec.count = env_int("RESILIENT_FAULT_COUNT", 0);
  spec.trigger_file = env_string("RESILIENT_FAULT_TRIGGER").value_or("");
  spec.delay_ms = env_double("RESILIENT_FAULT_DELAY_MS", 0.0);
  return spec;
}

Status install_fault_hook(const FaultSpec& spec) {
  Installed& s = installed();
  std::lock_guard<std::mutex> lock(s.mu);
  s.hook.reset();
  auto seen = std::make_shared<std::atomic<int64_t>>(0);
  auto hits = std::make_shared<std::atomic<int64_t>>(0);
  auto hook = [spec, seen, hits](FileOp op, const std::string& path) -> int {
    if (!(spec.ops & (1u << static_cast<int>(op)))) return 0;
    if (!spec.path_contains.empty() && path.find(spec.path_contains) == std::string::npos) return 0;
    if (!spec.trigger_file.empty()) {
      struct stat st;
      if (::stat(spec.trigger_file.c_str(), &st) != 0) return 0;
    }
    if (seen->fetch_add(1) < spec.after) return 0;
    // Claim a hit in one atomic step, so `count` holds when several threads write at once
    // (files_per_rank > 1); `hits` counts only the calls failed or delayed.
    int64_t h = hits->load();
    do {
      if (spec.count > 0 && h >= spec.count) return 0;
    } while (!hits->compare_exchange_weak(h, h + 1));
    if (spec.delay_ms > 0)
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(spec.delay_ms));
    return spec.error;
  };
  try {
    s.hook = std::make_unique<ScopedFileHook>(hook);
  } catch (const std::logic_error& e) {
    return Status(StatusCode::kFailedPrecondition, e.what());
  }
  s.seen = std::move(seen);
  s.hits = std::move(hits);
  return Status();
}

int64_t clear_fault_hook() {
  Installed& s = installed();
  std::lock_guard<std::mutex> lock(s.mu);
  const int64_t n = s.hits ? s.hits->load() : 0;
  s.hook.reset();
  s.hits.reset();
  s.seen.reset();
  return n;
}

int64_t fault_hook_hits() {
  Installed& s = installed();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.hits ? s.hits->load() : 0;
}

}  // namespace resilient::io
