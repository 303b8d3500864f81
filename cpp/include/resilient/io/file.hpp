#pragma once
// Files and directories for the checkpoint engine: RAII descriptors that remember whether they
// use O_DIRECT, and the durable-rename primitives the commit protocol is built from.

#include <cstdint>
#include <string>
#include <vector>

#include "resilient/common/config.hpp"
#include "resilient/common/status.hpp"

namespace resilient::io {

/// Alignment required of buffers, offsets and lengths on O_DIRECT files.
inline constexpr uint64_t kDirectAlignment = 4096;
inline constexpr uint64_t align_up(uint64_t x, uint64_t a = kDirectAlignment) {
  return (x + a - 1) / a * a;
}

class Dir;

/// A move-only open file. Not thread-safe for close(); I/O through an IoEngine from one thread
/// at a time per engine (several engines may share a File).
class File {
 public:
  File() = default;
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  /// Creates (truncating) `path` for writing. `direct`: kOn requires O_DIRECT (error if the file
  /// system refuses it), kAuto tries O_DIRECT and falls back to buffered I/O (logged once per
  /// file system), kOff never uses it.
  static Result<File> create(const std::string& path, Feature direct);
  /// Opens `path` read-only with the same O_DIRECT policy.
  static Result<File> open_read(const std::string& path, Feature direct);
  /// As create() and open_read(), for the file `name` (one path component) of `dir`.
  static Result<File> create_at(const Dir& dir, const std::string& name, Feature direct);
  static Result<File> open_read_at(const Dir& dir, const std::string& name, Feature direct);

  int fd() const { return fd_; }
  bool direct() const { return direct_; }
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

  Result<uint64_t> size() const;
  /// fsync (data and metadata).
  Status sync() const;
  Status truncate(uint64_t length) const;
  /// Closes; reports the close error (which can carry a deferred write error).
  Status close();

 private:
  File(int fd, bool direct, std::string path) : fd_(fd), direct_(direct), path_(std::move(path)) {}
  int fd_ = -1;
  bool direct_ = false;
  std::string path_;
};

/// A move-only open directory (O_DIRECTORY descriptor), for opening what lies under it relative
/// to it: nothing below a Dir opened from a trusted path is reached through a symbolic link, and
/// nothing is written outside it. A symbolic link met where a directory or file is expected
/// fails with ELOOP (kIoError naming the path), or, read-only, kCorrupt "is a symbolic link
/// (refused)"; a component that is not a directory is ENOTDIR. Thread-safe (const).
class Dir {
 public:
  Dir() = default;
  ~Dir();
  Dir(Dir&& other) noexcept;
  Dir& operator=(Dir&& other) noexcept;
  Dir(const Dir&) = delete;
  Dir& operator=(const Dir&) = delete;

  /// Opens `path` (symbolic links in it are followed: it names the trusted root).
  static Result<Dir> open(const std::string& path);
  /// Opens the directory `rel` below this one: components separated by '/', none of them empty,
  /// "." or "..", and none followed if it is a symbolic link. `for_write` picks the error a
  /// link gives (see above).
  Result<Dir> open_dir(const std::string& rel, bool for_write) const;
  /// Creates the directory `name` (one component) in this one; ok if it is already a directory
  /// (not a link to one).
  Status make_dir(const std::string& name) const;
  /// fsync: makes creations and renames in this directory durable.
  Status sync() const;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  /// path() + "/" + name, for messages.
  std::string child(const std::string& name) const { return path_ + "/" + name; }

 private:
  Dir(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

/// mkdir -p. Ok if it already exists as a directory.
Status make_dirs(const std::string& path);
/// fsync a directory, making renames and creations in it durable.
Status sync_dir(const std::string& path);
/// rename(2) through the hook. Atomic within one file system.
Status rename_path(const std::string& from, const std::string& to);
/// Removes a file or a directory tree. Ok if it does not exist.
Status remove_tree(const std::string& path);
/// What write_file_atomic() makes durable before it returns.
enum class Sync {
  kFileAndDir,  // the content and the rename (fsync of the file, then of the directory)
  kFile,        // the content; the caller fsyncs the directory later (one fsync for many files)
  kNone,        // nothing: a hint, which a crash may leave stale, empty or missing
};
/// Writes `bytes` to `path` atomically: temp file in the same directory, fsync, rename over
/// `path`, fsync the directory (as `sync` says). A crash leaves the old or the new content.
Status write_file_atomic(const std::string& path, const std::string& bytes,
                         Sync sync = Sync::kFileAndDir);
/// As write_file_atomic() for the file `name` of `dir` (the temporary file, the rename and the
/// fsync all relative to `dir`).
Status write_file_atomic_at(const Dir& dir, const std::string& name, const std::string& bytes,
                            Sync sync = Sync::kFileAndDir);
/// Reads a whole (small) file; `max_bytes` guards against absurd sizes (kCorrupt if larger).
Result<std::string> read_small_file(const std::string& path, uint64_t max_bytes);
/// As read_small_file() for the file `name` of `dir`.
Result<std::string> read_small_file_at(const Dir& dir, const std::string& name, uint64_t max_bytes);
/// Names in a directory (no "." or ".."), unsorted. kNotFound if it does not exist.
Result<std::vector<std::string>> list_dir(const std::string& path);

}  // namespace resilient::io
