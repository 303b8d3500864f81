// Restore from the page cache: a chunk whose pages are all cached is taken from there (the same
// bytes, its checksum verified), one whose pages are not, or were evicted before the read got
// them, from the device; chunk by chunk.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <numeric>

#include "io_test_util.hpp"
#include "resilient/checkpoint/checkpointer.hpp"
#include "resilient/checkpoint/commit.hpp"
#include "resilient/checkpoint/restore.hpp"
#include "resilient/io/file_hooks.hpp"
#include "resilient/io/page_cache.hpp"

namespace resilient::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

constexpr uint64_t kFloats = 1 << 20;  // 4 MiB: 64 chunks of 64 KiB

class RestoreCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("resilient-cache-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    auto o = CheckpointOptions::from_env(root_.string()).value();
    o.chunk_bytes = 64 << 10;
    o.pool.slab_bytes = 1 << 20;
    o.pool.budget_bytes = 64 << 20;
    o.timeout = 30s;
    auto c = Checkpointer::create(o);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    ckpt_ = std::move(c).value();
    saved_.resize(kFloats);
    std::iota(saved_.begin(), saved_.end(), 0.5f);
    small_ = {1, 2, 3};
    std::vector<TensorSpec> specs = {
        TensorSpec{"big", "float32", {kFloats}, saved_.data(), kFloats * 4},
        TensorSpec{"small", "int64", {3}, small_.data(), 24}};
    auto h = ckpt_->save(1, specs, {});
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE((*h)->wait(30s).ok());
    auto m = ckpt_->manifest(1);
    ASSERT_TRUE(m.ok());
    manifest_ = std::move(m).value();
    step_dir_ = step_dir_path(root_.string(), 1);
    data_ = step_dir_ + "/" + manifest_.shards.at(0).file;
    evict();
    auto f = io::File::open_read(data_, Feature::kAuto);
    ASSERT_TRUE(f.ok());
    if (!f->direct()) GTEST_SKIP() << "O_DIRECT refused here: every read goes through the cache";
  }
  void TearDown() override {
    ckpt_.reset();
    fs::remove_all(root_);
  }

  void evict() {
    int fd = ::open(data_.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  // Brings bytes [offset, offset + n) of the data file into the page cache, and only those
  // (what readahead brought in around them is evicted again).
  void warm(uint64_t offset, uint64_t n) {
    std::vector<char> buf(n);
    int fd = ::open(data_.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_GT(::pread(fd, buf.data(), n, static_cast<off_t>(offset)), 0);
    if (offset > 0) ::posix_fadvise(fd, 0, static_cast<off_t>(offset), POSIX_FADV_DONTNEED);
    ::posix_fadvise(fd, static_cast<off_t>(offset + n), 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  uint64_t data_size() const { return fs::file_size(data_); }

  // Restores into fresh buffers; `cached` gets the bytes taken from the page cache.
  Status restore(uint64_t& cached, bool page_cache = true) {
    big_.assign(kFloats, 0);
    got_small_.assign(3, 0);
    std::vector<ReadTarget> t = {{"big", big_.data(), kFloats * 4},
                                 {"small", got_small_.data(), 24}};
    RestoreOptions o;
    o.threads = 1;  // chunks in file order: the hooks below count on it
    o.io.request_bytes = 256 << 10;
    o.page_cache = page_cache;
    o.bytes_cached = &cached;
    memory::HostPool pool(memory::PoolOptions{.slab_bytes = 1 << 20, .budget_bytes = 16 << 20});
    return restore_tensors(step_dir_, manifest_, t, o, pool);
  }
  void expect_restored() {
    EXPECT_TRUE(big_ == saved_);
    EXPECT_EQ(got_small_, small_);
  }

  fs::path root_;
  std::unique_ptr<Checkpointer> ckpt_;
  Manifest manifest_;
  std::string step_dir_, data_;
  std::vector<float> saved_, big_;
  std::vector<int64_t> small_, got_small_;
};

TEST_F(RestoreCacheTest, ColdFilesAreReadFromTheDevice) {
  uint64_t cached = 1;
  ASSERT_TRUE(restore(cached).ok());
  expect_restored();
  EXPECT_EQ(cached, 0u);
}

TEST_F(RestoreCacheTest, CachedFilesAreTakenFromTheCacheWithTheSameBytes) {
  warm(0, data_size());
  uint64_t cached = 0;
  ASSERT_TRUE(restore(cached).ok());
  expect_restored();
  EXPECT_EQ(cached, kFloats * 4 + 24);
  ASSERT_TRUE(restore(cached, /*page_cache=*/false).ok());  // switched off: the device
  expect_restored();
  EXPECT_EQ(cached, 0u);
}

// Half the file cached: its whole chunks come from the cache, every other from the device.
TEST_F(RestoreCacheTest, APartlyCachedFileIsReadChunkByChunk) {
  warm(0, data_size() / 2);
  uint64_t cached = 0;
  ASSERT_TRUE(restore(cached).ok());
  expect_restored();
  EXPECT_GT(cached, 0u);
  EXPECT_LT(cached, kFloats * 4);
  EXPECT_TRUE(cached % (64 << 10) == 0 || cached % (64 << 10) == 24) << "whole chunks only";
}

// Pages evicted between the probe and the read (the cache read gets nothing): those chunks come
// from the device, the others from the cache.
TEST_F(RestoreCacheTest, ChunksEvictedBeforeTheReadFallBackToTheDevice) {
  warm(0, data_size());
  std::atomic<int> reads{0};
  uint64_t cached = 0;
  {
    // The first three reads are cache reads of the first three chunks (one thread, file order);
    // EAGAIN is "not cached" to them. The engine retries an EAGAIN, so nothing else changes.
    io::ScopedFileHook hook([&](io::FileOp op, const std::string&) {
      return op == io::FileOp::kRead && ++reads <= 3 ? EAGAIN : 0;
    });
    ASSERT_TRUE(restore(cached).ok());
  }
  expect_restored();
  std::vector<Chunk> in_file;
  for (const auto& t : manifest_.tensors)
    in_file.insert(in_file.end(), t.chunks.begin(), t.chunks.end());
  std::sort(in_file.begin(), in_file.end(), [](auto& a, auto& b) { return a.offset < b.offset; });
  EXPECT_EQ(cached, kFloats * 4 + 24 - in_file[0].raw - in_file[1].raw - in_file[2].raw);
}

// A chunk read from the cache is checked as one read from the device is.
TEST_F(RestoreCacheTest, ChecksumsAreVerifiedOnTheCachedPath) {
  const uint64_t offset = manifest_.tensors[0].chunks.at(5).offset + 100;
  io::testing::flip_byte(data_, offset);  // through the cache: the cached copy is damaged
  warm(0, data_size());
  uint64_t cached = 0;
  Status s = restore(cached);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_EQ(s.path(), data_);
  EXPECT_EQ(s.offset().value_or(0), manifest_.tensors[0].chunks.at(5).offset);
  EXPECT_GT(cached, 0u);
}

}  // namespace
}  // namespace resilient::checkpoint
