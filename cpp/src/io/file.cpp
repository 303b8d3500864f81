#include "resilient/io/file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <sstream>

#include "resilient/common/logging.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::io {
namespace {

std::string parent_dir(const std::string& path) {
  auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

std::string base_name(const std::string& path) {
  auto pos = path.find_last_of('/');
  return pos == std::string::npos ? path : path.substr(pos + 1);
}

// Files are opened without following a symlink in the last component, and without blocking
// (a FIFO planted in place of a shard would block open() forever); anything that is not a
// regular file is refused. O_NONBLOCK is cleared again once the file is known to be regular.
constexpr int kSafeOpen = O_NOFOLLOW | O_NONBLOCK;

Result<int> checked_regular(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    sys::close(fd);
    return Status::from_errno(err, "fstat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    sys::close(fd);
    return Status(StatusCode::kCorrupt, "not a regular file").with_path(path);
  }
  int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

// A symlink met when reading a checkpoint makes it corrupt (load falls back); when writing, it
// is an I/O error (ELOOP) of that save.
Status open_error(int err, int flags, const char* what, const std::string& path) {
  if (err == ELOOP && (flags & O_ACCMODE) == O_RDONLY) {
    return Status(StatusCode::kCorrupt, "is a symbolic link (refused)").with_path(path);
  }
  if (err == ELOOP)
    return Status::from_errno(err, "refusing to write through a symbolic link", path);
  return Status::from_errno(err, what, path);
}

// Opens with the O_DIRECT policy. On kAuto an EINVAL from the O_DIRECT open (the file system
// refuses direct I/O: tmpfs on older kernels, some network file systems) retries buffered and
// logs once per file system.
// `dirfd` and `name` as for openat(2) (AT_FDCWD and the path itself for a plain open); `path`
// names the file in errors and for the hooks.
Result<std::pair<int, bool>> open_with_policy(int dirfd, const std::string& name,
                                              const std::string& path, int flags, Feature direct,
                                              const char* what) {
  if (direct != Feature::kOff) {
    int fd = sys::openat(dirfd, name.c_str(), path, flags | O_DIRECT | kSafeOpen);
    if (fd >= 0) {
      RESILIENT_ASSIGN_OR_RETURN(fd, checked_regular(fd, path));
      return std::make_pair(fd, true);
    }
    int err = errno;
    if (err != EINVAL) return open_error(err, flags, what, path);
    if (direct == Feature::kOn) {
      return Status(StatusCode::kUnavailable,
                    "O_DIRECT refused by the file system and RESILIENT_O_DIRECT=on (" + path + ")")
          .with_errno(EINVAL)
          .with_path(path);
    }
    struct statfs fs {};
    std::string dir = parent_dir(path);
    long type = ::statfs(dir.c_str(), &fs) == 0 ? static_cast<long>(fs.f_type) : 0;
    std::ostringstream key, msg;
    key << "io.odirect_refused." << std::hex << type;
    msg << "O_DIRECT refused by the file system (type 0x" << std::hex << type << ", at " << dir
        << "); using buffered I/O with fsync";
    log_once(key.str(), LogLevel::kInfo, msg.str());
  }
  int fd = sys::openat(dirfd, name.c_str(), path, flags | kSafeOpen);
  if (fd < 0) return open_error(errno, flags, what, path);
  RESILIENT_ASSIGN_OR_RETURN(fd, checked_regular(fd, path));
  return std::make_pair(fd, false);
}

Result<std::pair<int, bool>> open_with_policy(const std::string& path, int flags, Feature direct,
                                              const char* what) {
  return open_with_policy(AT_FDCWD, path, path, flags, direct, what);
}

// One path component: no '/', not empty, "." or "..".
bool plain_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

Status bad_name(const std::string& name) {
  return Status(StatusCode::kInvalidArgument, "not a plain file name: '" + name + "'");
}

// Reads a whole (small) file opened as openat(dirfd, name) would; `path` names it in errors.
Result<std::string> read_fd_file(int dirfd, const std::string& name, const std::string& path,
                                 uint64_t max_bytes) {
  int fd = sys::openat(dirfd, name.c_str(), path, O_RDONLY | kSafeOpen);
  if (fd < 0) return open_error(errno, O_RDONLY, "open", path);
  RESILIENT_ASSIGN_OR_RETURN(fd, checked_regular(fd, path));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    sys::close(fd);
    return Status::from_errno(err, "fstat", path);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    sys::close(fd);
    return Status(StatusCode::kCorrupt, "file is " + std::to_string(size) +
                                            " bytes, more than the limit of " +
                                            std::to_string(max_bytes))
        .with_path(path);
  }
  std::string out(size, '\0');
  uint64_t done = 0;
  while (done < size) {
    ssize_t n = sys::pread(fd, out.data() + done, size - done, static_cast<off_t>(done));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) {
      int err = errno;
      sys::close(fd);
      return Status::from_errno(err, "read", path).with_offset(done);
    }
    if (n == 0) break;  // shrank while reading
    done += static_cast<uint64_t>(n);
  }
  sys::close(fd);
  out.resize(done);
  return out;
}

Status remove_tree_at(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return ok_status();
    return Status::from_errno(errno, "stat", path);
  }
  if (!S_ISDIR(st.st_mode)) {
    if (sys::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return Status::from_errno(errno, "unlink", path);
    }
    return ok_status();
  }
  RESILIENT_ASSIGN_OR_RETURN(auto names, list_dir(path));
  for (const std::string& name : names) {
    RESILIENT_RETURN_IF_ERROR(remove_tree_at(path + "/" + name));
  }
  if (sys::rmdir(path.c_str()) != 0 && errno != ENOENT) {
    return Status::from_errno(errno, "rmdir", path);
  }
  return ok_status();
}

}  // namespace

File::~File() {
  if (fd_ >= 0) sys::close(fd_);
}

File::File(File&& other) noexcept
    : fd_(other.fd_), direct_(other.direct_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) sys::close(fd_);
    fd_ = other.fd_;
    direct_ = other.direct_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

Result<File> File::create(const std::string& path, Feature direct) {
  RESILIENT_ASSIGN_OR_RETURN(
      auto opened, open_with_policy(path, O_WRONLY | O_CREAT | O_TRUNC, direct, "create"));
  return File(opened.first, opened.second, path);
}

Result<File> File::open_read(const std::string& path, Feature direct) {
  RESILIENT_ASSIGN_OR_RETURN(auto opened, open_with_policy(path, O_RDONLY, direct, "open"));
  return File(opened.first, opened.second, path);
}

Result<File> File::create_at(const Dir& dir, const std::string& name, Feature direct) {
  if (!plain_name(name)) return bad_name(name);
  const std::string path = dir.child(name);
  RESILIENT_ASSIGN_OR_RETURN(
      auto opened,
      open_with_policy(dir.fd(), name, path, O_WRONLY | O_CREAT | O_TRUNC, direct, "create"));
  return File(opened.first, opened.second, path);
}

Result<File> File::open_read_at(const Dir& dir, const std::string& name, Feature direct) {
  if (!plain_name(name)) return bad_name(name);
  const std::string path = dir.child(name);
  RESILIENT_ASSIGN_OR_RETURN(auto opened,
                             open_with_policy(dir.fd(), name, path, O_RDONLY, direct, "open"));
  return File(opened.first, opened.second, path);
}

Result<uint64_t> File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return Status::from_errno(errno, "fstat", path_);
  return static_cast<uint64_t>(st.st_size);
}

Status File::sync() const {
  if (sys::fsync(fd_) != 0) return Status::from_errno(errno, "fsync", path_);
  return ok_status();
}

Status File::truncate(uint64_t length) const {
  if (sys::ftruncate(fd_, static_cast<off_t>(length)) != 0) {
    return Status::from_errno(errno, "ftruncate", path_).with_offset(length);
  }
  return ok_status();
}

Status File::close() {
  if (fd_ < 0) return ok_status();
  int fd = fd_;
  fd_ = -1;
  if (sys::close(fd) != 0) return Status::from_errno(errno, "close", path_);
  return ok_status();
}

// --- Dir ----------------------------------------------------------------------------------

Dir::~Dir() {
  if (fd_ >= 0) sys::close(fd_);
}

Dir::Dir(Dir&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

Dir& Dir::operator=(Dir&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) sys::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

Result<Dir> Dir::open(const std::string& path) {
  int fd = sys::open(path.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return Status::from_errno(errno, "open directory", path);
  return Dir(fd, path);
}

Result<Dir> Dir::open_dir(const std::string& rel, bool for_write) const {
  int at = fd_;
  std::string path = path_;
  Dir out;
  size_t begin = 0;
  for (;;) {
    const size_t end = rel.find('/', begin);
    const std::string name = rel.substr(begin, end == std::string::npos ? end : end - begin);
    if (!plain_name(name)) return bad_name(rel);
    path += "/" + name;
    // O_NOFOLLOW on every component: a symbolic link is refused (ELOOP), never followed.
    int fd = sys::openat(at, name.c_str(), path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (fd < 0) {
      const int err = errno;
      if (err == ELOOP || err == ENOTDIR) {
        struct stat st {};
        if (::fstatat(at, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
          return open_error(ELOOP, for_write ? O_WRONLY : O_RDONLY, "open directory", path);
        }
      }
      return Status::from_errno(err, "open directory", path);
    }
    out = Dir(fd, path);
    at = fd;
    if (end == std::string::npos) return out;
    begin = end + 1;
  }
}

Status Dir::make_dir(const std::string& name) const {
  if (!plain_name(name)) return bad_name(name);
  const std::string path = child(name);
  if (sys::mkdirat(fd_, name.c_str(), path) == 0) return ok_status();
  const int err = errno;
  struct stat st {};
  if (err == EEXIST && ::fstatat(fd_, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (S_ISDIR(st.st_mode)) return ok_status();
    if (S_ISLNK(st.st_mode)) return open_error(ELOOP, O_WRONLY, "mkdir", path);
    return Status::from_errno(ENOTDIR, "mkdir", path);
  }
  return Status::from_errno(err, "mkdir", path);
}

Status Dir::sync() const {
  if (sys::fsync(fd_) != 0) return Status::from_errno(errno, "fsync directory", path_);
  return ok_status();
}

Status make_dirs(const std::string& path) {
  if (path.empty()) return Status(StatusCode::kInvalidArgument, "make_dirs: empty path");
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    std::string prefix = path.substr(0, pos);
    if (prefix.empty() || prefix == "/") continue;
    if (sys::mkdir(prefix.c_str(), 0755) == 0) continue;
    int err = errno;
    struct stat st {};
    if (err == EEXIST && ::stat(prefix.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
    if (err == EEXIST) err = ENOTDIR;
    return Status::from_errno(err, "mkdir", prefix);
  }
  return ok_status();
}

Status sync_dir(const std::string& path) {
  int fd = sys::open(path.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return Status::from_errno(errno, "open directory", path);
  Status st = ok_status();
  if (sys::fsync(fd) != 0) st = Status::from_errno(errno, "fsync directory", path);
  sys::close(fd);
  return st;
}

Status rename_path(const std::string& from, const std::string& to) {
  if (sys::rename(from.c_str(), to.c_str()) != 0) {
    return Status::from_errno(errno, "rename to " + to, from);
  }
  return ok_status();
}

Status remove_tree(const std::string& path) { return remove_tree_at(path); }

Status write_file_atomic(const std::string& path, const std::string& bytes, Sync sync) {
  RESILIENT_ASSIGN_OR_RETURN(Dir dir, Dir::open(parent_dir(path)));
  return write_file_atomic_at(dir, base_name(path), bytes, sync);
}

Status write_file_atomic_at(const Dir& dir, const std::string& name, const std::string& bytes,
                            Sync sync) {
  static std::atomic<uint64_t> counter{0};
  if (!plain_name(name)) return bad_name(name);
  const std::string path = dir.child(name);
  const std::string tmp_name = "." + name + ".tmp." + std::to_string(::getpid()) + "." +
                               std::to_string(counter.fetch_add(1));
  const std::string tmp = dir.child(tmp_name);
  int fd =
      sys::openat(dir.fd(), tmp_name.c_str(), tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644);
  if (fd < 0) return Status::from_errno(errno, "create", tmp);
  Status st = ok_status();
  uint64_t done = 0;
  while (st.ok() && done < bytes.size()) {
    ssize_t n = sys::pwrite(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      st = Status::from_errno(n < 0 ? errno : EIO, "write", tmp).with_offset(done);
    } else {
      done += static_cast<uint64_t>(n);
    }
  }
  if (st.ok() && sync != Sync::kNone && sys::fsync(fd) != 0) {
    st = Status::from_errno(errno, "fsync", tmp);
  }
  if (sys::close(fd) != 0 && st.ok()) st = Status::from_errno(errno, "close", tmp);
  if (st.ok() && sys::renameat(dir.fd(), tmp_name.c_str(), name.c_str(), tmp) != 0) {
    st = Status::from_errno(errno, "rename to " + path, tmp);
  }
  if (!st.ok()) {
    sys::unlinkat(dir.fd(), tmp_name.c_str(), tmp);
    return st;
  }
  return sync == Sync::kFileAndDir ? dir.sync() : ok_status();
}

Result<std::string> read_small_file(const std::string& path, uint64_t max_bytes) {
  return read_fd_file(AT_FDCWD, path, path, max_bytes);
}

Result<std::string> read_small_file_at(const Dir& dir, const std::string& name,
                                       uint64_t max_bytes) {
  if (!plain_name(name)) return bad_name(name);
  return read_fd_file(dir.fd(), name, dir.child(name), max_bytes);
}

Result<std::vector<std::string>> list_dir(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return Status::from_errno(errno, "opendir", path);
  std::vector<std::string> names;
  errno = 0;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
    errno = 0;
  }
  int err = errno;
  ::closedir(d);
  if (err != 0) return Status::from_errno(err, "readdir", path);
  return names;
}

}  // namespace resilient::io
