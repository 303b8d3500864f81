#pragma once
// Helpers shared by the io and checkpoint tests: a temporary directory removed at the end,
// aligned buffers, a corrupted byte.

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "resilient/io/file.hpp"

namespace resilient::io::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& base = "/tmp") {
    std::string tmpl = base + "/resilient-io-test-XXXXXX";
    char* p = ::mkdtemp(tmpl.data());
    if (p == nullptr) throw std::runtime_error("mkdtemp failed in " + base);
    path_ = p;
  }
  ~TempDir() { (void)remove_tree(path_); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

/// Flips a bit of the byte at `offset` of the file at `path` (a corrupted checkpoint, say).
inline void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  char b = 0;
  f.seekg(static_cast<std::streamoff>(offset));
  f.read(&b, 1);
  b ^= 0x10;
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&b, 1);
  if (!f) throw std::runtime_error("cannot flip a byte of " + path);
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, FreeDeleter>;

/// A 4 KiB aligned buffer filled with a pattern that depends on `seed` and the position.
inline AlignedBuffer pattern_buffer(uint64_t bytes, uint32_t seed) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, bytes ? bytes : 4096) != 0) throw std::bad_alloc();
  auto* b = static_cast<std::byte*>(p);
  for (uint64_t i = 0; i < bytes; ++i) b[i] = std::byte((i * 131 + seed * 7 + (i >> 12)) & 0xff);
  return AlignedBuffer(b);
}

inline AlignedBuffer zero_buffer(uint64_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, bytes ? bytes : 4096) != 0) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return AlignedBuffer(static_cast<std::byte*>(p));
}

}  // namespace resilient::io::testing
