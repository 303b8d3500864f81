#pragma once
// Hookable wrappers for every file syscall the engine makes, so tests can make write, fsync,
// rename (and io_uring requests) fail with a chosen errno. With no hook installed the wrappers
// cost one relaxed atomic load.

#include <fcntl.h>
#include <sys/types.h>

#include <functional>
#include <string>

namespace resilient::io {

enum class FileOp {
  kOpen,
  kWrite,
  kRead,
  kFsync,
  kRename,
  kUnlink,
  kMkdir,
  kRmdir,
  kTruncate,
  kClose
};
const char* file_op_name(FileOp op);

/// Called before each syscall with the operation and the file's path (for fd-based calls, the
/// path the fd was opened with). Return 0 to let the call proceed, or an errno value to make it
/// fail with that errno without running it. For kWrite, returning -N (N > 0) makes the write
/// short: only N bytes are written (to test short-write handling); likewise -N for kRead.
/// EAGAIN/EINTR are retried by the I/O engines, so a hook can inject transient failures.
using FileHook = std::function<int(FileOp op, const std::string& path)>;

/// Installs `hook` for the lifetime of the object (tests only; one at a time). Thread-safe.
class ScopedFileHook {
 public:
  explicit ScopedFileHook(FileHook hook);
  ~ScopedFileHook();
  ScopedFileHook(const ScopedFileHook&) = delete;
  ScopedFileHook& operator=(const ScopedFileHook&) = delete;
};

/// Consults the installed hook (0 when none). Used by the wrappers and by the io_uring engine
/// before submitting each request.
int file_hook(FileOp op, int fd);
int file_hook(FileOp op, const std::string& path);

// The wrappers: same contract as the syscalls (return -1 and set errno on failure).
namespace sys {
int open(const char* path, int flags, mode_t mode = 0644);
/// openat(2); `path` (the directory's path and `name`) is what hooks and fd_path() see.
int openat(int dirfd, const char* name, const std::string& path, int flags, mode_t mode = 0644);
/// renameat(2) within one directory; hooked as kRename with `path` (the source's path).
int renameat(int dirfd, const char* from, const char* to, const std::string& path);
/// unlinkat(2) of a file; hooked as kUnlink with `path`.
int unlinkat(int dirfd, const char* name, const std::string& path);
/// mkdirat(2); hooked as kMkdir with `path`.
int mkdirat(int dirfd, const char* name, const std::string& path, mode_t mode = 0755);
int close(int fd);
ssize_t pwrite(int fd, const void* buf, size_t n, off_t off);
ssize_t pread(int fd, void* buf, size_t n, off_t off);
/// preadv2(2) of one buffer with RWF_NOWAIT (from the page cache only); hooked as kRead.
ssize_t pread_nowait(int fd, void* buf, size_t n, off_t off);
int fsync(int fd);
int rename(const char* from, const char* to);
int unlink(const char* path);
int mkdir(const char* path, mode_t mode = 0755);
int rmdir(const char* path);
int ftruncate(int fd, off_t len);
}  // namespace sys

}  // namespace resilient::io
