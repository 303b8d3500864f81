// CachedPages and read_cached: residency is told page by page without reading anything, and a
// read from the cache returns the file's bytes, or stops where a page is not cached.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "io_test_util.hpp"
#include "resilient/io/file_hooks.hpp"
#include "resilient/io/page_cache.hpp"

namespace resilient::io {
namespace {

using testing::pattern_buffer;
using testing::TempDir;
using testing::zero_buffer;

constexpr uint64_t kBytes = 1 << 20;

// A file of kBytes of pattern whose pages are then evicted from the page cache.
std::string cold_file(const TempDir& dir, testing::AlignedBuffer& want) {
  const std::string path = dir.file("f");
  want = pattern_buffer(kBytes, 3);
  int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::write(fd, want.get(), kBytes), static_cast<ssize_t>(kBytes));
  EXPECT_EQ(::fdatasync(fd), 0);
  EXPECT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
  return path;
}

// Brings [offset, offset + n) into the page cache with a plain buffered read, and only that
// (what readahead brought in around it is evicted again).
void warm(const std::string& path, uint64_t offset, uint64_t n) {
  auto buf = zero_buffer(n);
  int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pread(fd, buf.get(), n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  if (offset > 0) ::posix_fadvise(fd, 0, static_cast<off_t>(offset), POSIX_FADV_DONTNEED);
  ::posix_fadvise(fd, static_cast<off_t>(offset + n), 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

TEST(CachedPages, ToldPageByPageWithoutReading) {
  TempDir dir;
  testing::AlignedBuffer want;
  const std::string path = cold_file(dir, want);
  auto f = File::open_read(path, Feature::kAuto);
  ASSERT_TRUE(f.ok());
  auto pages = CachedPages::map(*f);
  ASSERT_TRUE(pages.ok()) << pages.status().to_string();
  if (pages->resident(0, 4096)) GTEST_SKIP() << "this file system keeps pages cached (tmpfs?)";
  EXPECT_FALSE(pages->resident(0, kBytes));
  EXPECT_FALSE(pages->resident(0, kBytes));  // asking twice read nothing either
  warm(path, 256 << 10, 256 << 10);
  EXPECT_TRUE(pages->resident(256 << 10, 256 << 10));
  EXPECT_TRUE(pages->resident((256 << 10) + 100, 5000));  // unaligned, inside
  EXPECT_FALSE(pages->resident((256 << 10) - 1, 2));      // one byte in an uncached page
  EXPECT_FALSE(pages->resident(256 << 10, kBytes - (256 << 10)));
  EXPECT_FALSE(pages->resident(256 << 10, 0));         // an empty range
  EXPECT_FALSE(pages->resident(kBytes - 4096, 8192));  // past the end
}

TEST(CachedPages, EmptyFileMapsToNothing) {
  TempDir dir;
  auto f = File::create(dir.file("empty"), Feature::kOff);
  ASSERT_TRUE(f.ok());
  auto pages = CachedPages::map(*f);
  ASSERT_TRUE(pages.ok());
  EXPECT_FALSE(pages->resident(0, 1));
}

TEST(ReadCached, ReturnsTheFilesBytesOrStopsAtAnUncachedPage) {
  TempDir dir;
  testing::AlignedBuffer want;
  const std::string path = cold_file(dir, want);
  auto f = File::open_read(path, Feature::kOff);
  ASSERT_TRUE(f.ok());
  auto pages = CachedPages::map(*f);
  ASSERT_TRUE(pages.ok());
  if (pages->resident(0, 4096)) GTEST_SKIP() << "this file system keeps pages cached (tmpfs?)";
  warm(path, 0, 512 << 10);
  auto got = zero_buffer(kBytes);
  auto n = read_cached(*f, got.get() + 1000, 300000, 1000);  // unaligned: buffered
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  EXPECT_EQ(*n, 300000u);
  EXPECT_EQ(std::memcmp(got.get() + 1000, want.get() + 1000, 300000), 0);
  // Half cached: the cached half, then it stops instead of waiting for the device.
  auto half = read_cached(*f, got.get(), 1 << 20, 0);
  ASSERT_TRUE(half.ok());
  EXPECT_GE(*half, 512u << 10);
  EXPECT_LT(*half, kBytes);
  EXPECT_EQ(std::memcmp(got.get(), want.get(), *half), 0);
}

TEST(ReadCached, NeedsABufferedFileAndReportsErrors) {
  TempDir dir;
  testing::AlignedBuffer want;
  const std::string path = cold_file(dir, want);
  auto direct = File::open_read(path, Feature::kAuto);
  ASSERT_TRUE(direct.ok());
  auto buf = zero_buffer(4096);
  if (direct->direct()) {
    EXPECT_EQ(read_cached(*direct, buf.get(), 4096, 0).status().code(),
              StatusCode::kInvalidArgument);
  }
  auto f = File::open_read(path, Feature::kOff);
  ASSERT_TRUE(f.ok());
  warm(path, 0, 4096);
  {
    ScopedFileHook hook(
        [](FileOp op, const std::string&) { return op == FileOp::kRead ? EIO : 0; });
    auto n = read_cached(*f, buf.get(), 4096, 0);
    EXPECT_EQ(n.status().code(), StatusCode::kIoError);
    EXPECT_EQ(n.status().sys_errno(), EIO);
    EXPECT_EQ(n.status().path(), path);
  }
  {  // "not cached" (EAGAIN) is no error: nothing read
    ScopedFileHook hook(
        [](FileOp op, const std::string&) { return op == FileOp::kRead ? EAGAIN : 0; });
    auto n = read_cached(*f, buf.get(), 4096, 0);
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(*n, 0u);
  }
}

}  // namespace
}  // namespace resilient::io
