#pragma once
// Helpers shared by the io tests: a temporary directory removed at the end, aligned buffers.

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
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
