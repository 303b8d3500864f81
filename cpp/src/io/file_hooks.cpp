#include "resilient/io/file_hooks.hpp"

#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <unordered_map>

namespace resilient::io {
namespace {

// The hook and the fd -> path registry. The fast path (no hook) is one relaxed load; the
// registry is maintained by open/close but only read while a hook is installed.
struct HookState {
  std::atomic<bool> installed{false};
  std::shared_mutex mu;
  std::shared_ptr<FileHook> hook;
  std::mutex fd_mu;
  std::unordered_map<int, std::string> fd_paths;
};

HookState& state() {
  static HookState* s = new HookState();  // never destroyed: usable during static teardown
  return *s;
}

std::string fd_path(int fd) {
  HookState& s = state();
  {
    std::lock_guard<std::mutex> lock(s.fd_mu);
    auto it = s.fd_paths.find(fd);
    if (it != s.fd_paths.end()) return it->second;
  }
  // Opened before the registry saw it (or not through the wrappers): ask the kernel.
  char link[64];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  char buf[4096];
  ssize_t n = ::readlink(link, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

void remember_fd(int fd, const char* path) {
  HookState& s = state();
  std::lock_guard<std::mutex> lock(s.fd_mu);
  s.fd_paths[fd] = path;
}

void forget_fd(int fd) {
  HookState& s = state();
  std::lock_guard<std::mutex> lock(s.fd_mu);
  s.fd_paths.erase(fd);
}

// Runs the hook for a path-based call; returns true (errno set) when the call must fail.
bool fail_path(FileOp op, const char* path) {
  int e = file_hook(op, std::string(path));
  if (e > 0) {
    errno = e;
    return true;
  }
  return false;
}

bool fail_fd(FileOp op, int fd) {
  int e = file_hook(op, fd);
  if (e > 0) {
    errno = e;
    return true;
  }
  return false;
}

}  // namespace

const char* file_op_name(FileOp op) {
  switch (op) {
    case FileOp::kOpen:
      return "open";
    case FileOp::kWrite:
      return "write";
    case FileOp::kRead:
      return "read";
    case FileOp::kFsync:
      return "fsync";
    case FileOp::kRename:
      return "rename";
    case FileOp::kUnlink:
      return "unlink";
    case FileOp::kMkdir:
      return "mkdir";
    case FileOp::kRmdir:
      return "rmdir";
    case FileOp::kTruncate:
      return "truncate";
    case FileOp::kClose:
      return "close";
  }
  return "unknown";
}

ScopedFileHook::ScopedFileHook(FileHook hook) {
  HookState& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mu);
  if (s.hook) throw std::logic_error("ScopedFileHook: a hook is already installed");
  s.hook = std::make_shared<FileHook>(std::move(hook));
  s.installed.store(true, std::memory_order_release);
}

ScopedFileHook::~ScopedFileHook() {
  HookState& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mu);
  s.installed.store(false, std::memory_order_release);
  s.hook.reset();
}

int file_hook(FileOp op, const std::string& path) {
  HookState& s = state();
  if (!s.installed.load(std::memory_order_relaxed)) return 0;
  std::shared_ptr<FileHook> hook;
  {
    std::shared_lock<std::shared_mutex> lock(s.mu);
    hook = s.hook;
  }
  return hook ? (*hook)(op, path) : 0;
}

int file_hook(FileOp op, int fd) {
  if (!state().installed.load(std::memory_order_relaxed)) return 0;
  return file_hook(op, fd_path(fd));
}

namespace sys {

int open(const char* path, int flags, mode_t mode) {
  if (fail_path(FileOp::kOpen, path)) return -1;
  int fd;
  do {
    fd = ::open(path, flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd >= 0) remember_fd(fd, path);
  return fd;
}

int openat(int dirfd, const char* name, const std::string& path, int flags, mode_t mode) {
  if (fail_path(FileOp::kOpen, path.c_str())) return -1;
  int fd;
  do {
    fd = ::openat(dirfd, name, flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd >= 0) remember_fd(fd, path.c_str());
  return fd;
}

int renameat(int dirfd, const char* from, const char* to, const std::string& path) {
  if (fail_path(FileOp::kRename, path.c_str())) return -1;
  return ::renameat(dirfd, from, dirfd, to);
}

int unlinkat(int dirfd, const char* name, const std::string& path) {
  if (fail_path(FileOp::kUnlink, path.c_str())) return -1;
  return ::unlinkat(dirfd, name, 0);
}

int mkdirat(int dirfd, const char* name, const std::string& path, mode_t mode) {
  if (fail_path(FileOp::kMkdir, path.c_str())) return -1;
  return ::mkdirat(dirfd, name, mode);
}

int close(int fd) {
  int hooked = file_hook(FileOp::kClose, fd);
  forget_fd(fd);
  int rc = ::close(fd);  // always release the descriptor, even when a failure is injected
  if (hooked > 0) {
    errno = hooked;
    return -1;
  }
  return rc;
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  int e = file_hook(FileOp::kWrite, fd);
  if (e > 0) {
    errno = e;
    return -1;
  }
  if (e < 0 && static_cast<size_t>(-e) < n) n = static_cast<size_t>(-e);
  return ::pwrite(fd, buf, n, off);
}

ssize_t pread(int fd, void* buf, size_t n, off_t off) {
  int e = file_hook(FileOp::kRead, fd);
  if (e > 0) {
    errno = e;
    return -1;
  }
  if (e < 0 && static_cast<size_t>(-e) < n) n = static_cast<size_t>(-e);
  return ::pread(fd, buf, n, off);
}

ssize_t pread_nowait(int fd, void* buf, size_t n, off_t off) {
  int e = file_hook(FileOp::kRead, fd);
  if (e > 0) {
    errno = e;
    return -1;
  }
  if (e < 0 && static_cast<size_t>(-e) < n) n = static_cast<size_t>(-e);
  iovec iov{buf, n};
  return ::preadv2(fd, &iov, 1, off, RWF_NOWAIT);
}

int fsync(int fd) {
  if (fail_fd(FileOp::kFsync, fd)) return -1;
  return ::fsync(fd);
}

int rename(const char* from, const char* to) {
  if (fail_path(FileOp::kRename, from)) return -1;
  return ::rename(from, to);
}

int unlink(const char* path) {
  if (fail_path(FileOp::kUnlink, path)) return -1;
  return ::unlink(path);
}

int mkdir(const char* path, mode_t mode) {
  if (fail_path(FileOp::kMkdir, path)) return -1;
  return ::mkdir(path, mode);
}

int rmdir(const char* path) {
  if (fail_path(FileOp::kRmdir, path)) return -1;
  return ::rmdir(path);
}

int ftruncate(int fd, off_t len) {
  if (fail_fd(FileOp::kTruncate, fd)) return -1;
  return ::ftruncate(fd, len);
}

}  // namespace sys
}  // namespace resilient::io
