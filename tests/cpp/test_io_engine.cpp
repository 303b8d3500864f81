// Both I/O engines (io_uring and the thread pool) against the same contract: round trips,
// splitting, short transfers, EAGAIN, injected EIO/ENOSPC, truncation, alignment and timeouts.

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "io/detail/uring_engine.hpp"
#include "io_test_util.hpp"
#include "resilient/io/engine.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::io {
namespace {

using testing::pattern_buffer;
using testing::TempDir;
using testing::zero_buffer;

constexpr Duration kLong = std::chrono::seconds(30);

IoOptions small_options(Feature uring) {
  IoOptions o;
  o.uring = uring;
  o.request_bytes = 64 << 10;  // many pieces per request
  o.queue_depth = 4;
  o.threads = 3;
  return o;
}

class EngineTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const bool uring = std::string(GetParam()) == "io_uring";
    auto e = IoEngine::create(small_options(uring ? Feature::kOn : Feature::kOff));
    if (!e.ok()) GTEST_SKIP() << "engine unavailable here: " << e.status().to_string();
    engine_ = std::move(e).value();
    ASSERT_STREQ(engine_->name(), GetParam());
  }

  // Writes `bytes` of pattern to a new file (direct policy `direct`) as two requests.
  Status write_pattern(const std::string& path, uint64_t bytes, Feature direct,
                       testing::AlignedBuffer& buf) {
    buf = pattern_buffer(bytes, 7);
    auto f = File::create(path, direct);
    if (!f.ok()) return f.status();
    const uint64_t half = bytes / 2 / 4096 * 4096;
    IoRequest reqs[] = {{buf.get(), half, 0}, {buf.get() + half, bytes - half, half}};
    RESILIENT_RETURN_IF_ERROR(engine_->write(*f, reqs, kLong));
    RESILIENT_RETURN_IF_ERROR(f->sync());
    return f->close();
  }

  void expect_file_equals(const std::string& path, const std::byte* want, uint64_t bytes,
                          Feature direct) {
    auto f = File::open_read(path, direct);
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    ASSERT_EQ(*f->size(), bytes);
    auto got = zero_buffer(bytes);
    IoRequest req{got.get(), bytes, 0};
    Status s = engine_->read(*f, {&req, 1}, kLong);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(std::memcmp(got.get(), want, bytes), 0);
  }

  TempDir dir_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_P(EngineTest, DirectRoundTripManyPieces) {
  testing::AlignedBuffer buf;
  const uint64_t bytes = 1 << 20;  // 16 pieces of 64 KiB
  ASSERT_TRUE(write_pattern(dir_.file("d"), bytes, Feature::kOn, buf).ok());
  expect_file_equals(dir_.file("d"), buf.get(), bytes, Feature::kOn);
}

TEST_P(EngineTest, BufferedRoundTripUnalignedSizes) {
  testing::AlignedBuffer buf;
  const uint64_t bytes = 300001;
  ASSERT_TRUE(write_pattern(dir_.file("b"), bytes, Feature::kOff, buf).ok());
  expect_file_equals(dir_.file("b"), buf.get(), bytes, Feature::kOff);
}

TEST_P(EngineTest, EmptyBatchIsOk) {
  auto f = File::create(dir_.file("e"), Feature::kAuto);
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(engine_->write(*f, {}, kLong).ok());
}

TEST_P(EngineTest, ShortWritesAreCompleted) {
  std::atomic<int> writes{0};
  ScopedFileHook hook([&](FileOp op, const std::string&) {
    if (op != FileOp::kWrite) return 0;
    ++writes;
    return -12345;  // every transfer moves at most 12345 bytes
  });
  testing::AlignedBuffer buf;
  const uint64_t bytes = 200000;
  ASSERT_TRUE(write_pattern(dir_.file("s"), bytes, Feature::kOff, buf).ok());
  EXPECT_GE(writes.load(), static_cast<int>(bytes / 12345));
  expect_file_equals(dir_.file("s"), buf.get(), bytes, Feature::kOff);
}

TEST_P(EngineTest, ShortDirectWritesAreCompleted) {
  std::atomic<int> writes{0};
  ScopedFileHook hook([&](FileOp op, const std::string&) {
    if (op != FileOp::kWrite) return 0;
    ++writes;
    return -8192;
  });
  testing::AlignedBuffer buf;
  const uint64_t bytes = 256 << 10;
  ASSERT_TRUE(write_pattern(dir_.file("sd"), bytes, Feature::kOn, buf).ok());
  EXPECT_EQ(writes.load(), static_cast<int>(bytes / 8192));
  expect_file_equals(dir_.file("sd"), buf.get(), bytes, Feature::kOn);
}

TEST_P(EngineTest, EagainAndEintrAreRetried) {
  std::atomic<int> calls{0};
  ScopedFileHook hook([&](FileOp op, const std::string&) {
    if (op != FileOp::kWrite && op != FileOp::kRead) return 0;
    int n = calls++;
    return n < 5 ? EAGAIN : n < 8 ? EINTR : 0;
  });
  testing::AlignedBuffer buf;
  const uint64_t bytes = 512 << 10;
  ASSERT_TRUE(write_pattern(dir_.file("a"), bytes, Feature::kOn, buf).ok());
  expect_file_equals(dir_.file("a"), buf.get(), bytes, Feature::kOn);
  EXPECT_GT(calls.load(), 8);
}

TEST_P(EngineTest, PersistentEagainTimesOut) {
  ScopedFileHook hook(
      [&](FileOp op, const std::string&) { return op == FileOp::kWrite ? EAGAIN : 0; });
  auto buf = pattern_buffer(1 << 16, 1);
  auto f = File::create(dir_.file("t"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  IoRequest req{buf.get(), 1 << 16, 0};
  Status s = engine_->write(*f, {&req, 1}, std::chrono::milliseconds(50));
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
  EXPECT_EQ(s.path(), dir_.file("t"));
}

TEST_P(EngineTest, InjectedEioOnWriteNamesFileAndOffset) {
  std::atomic<int> writes{0};
  ScopedFileHook hook([&](FileOp op, const std::string&) {
    return op == FileOp::kWrite && writes++ == 3 ? EIO : 0;
  });
  testing::AlignedBuffer buf;
  Status s = write_pattern(dir_.file("eio"), 1 << 20, Feature::kOn, buf);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_EQ(s.path(), dir_.file("eio"));
  ASSERT_TRUE(s.offset().has_value());
  EXPECT_EQ(*s.offset() % (64 << 10), 0u);
}

TEST_P(EngineTest, InjectedEnospcIsNoSpace) {
  ScopedFileHook hook(
      [&](FileOp op, const std::string&) { return op == FileOp::kWrite ? ENOSPC : 0; });
  testing::AlignedBuffer buf;
  Status s = write_pattern(dir_.file("full"), 1 << 20, Feature::kOn, buf);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.to_string();
  EXPECT_EQ(s.sys_errno(), ENOSPC);
}

TEST_P(EngineTest, InjectedEioOnRead) {
  testing::AlignedBuffer buf;
  ASSERT_TRUE(write_pattern(dir_.file("r"), 1 << 18, Feature::kOn, buf).ok());
  ScopedFileHook hook([&](FileOp op, const std::string&) { return op == FileOp::kRead ? EIO : 0; });
  auto f = File::open_read(dir_.file("r"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  auto got = zero_buffer(1 << 18);
  IoRequest req{got.get(), 1 << 18, 0};
  Status s = engine_->read(*f, {&req, 1}, kLong);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EIO);
}

TEST_P(EngineTest, ReadingPastEndIsTruncated) {
  testing::AlignedBuffer buf;
  ASSERT_TRUE(write_pattern(dir_.file("short"), 8192, Feature::kOn, buf).ok());
  auto f = File::open_read(dir_.file("short"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  auto got = zero_buffer(1 << 16);
  IoRequest req{got.get(), 1 << 16, 0};
  Status s = engine_->read(*f, {&req, 1}, kLong);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_NE(s.message().find("truncated"), std::string::npos);
  EXPECT_EQ(s.path(), dir_.file("short"));
  EXPECT_EQ(s.offset().value_or(0), 8192u);
}

TEST_P(EngineTest, DirectReadOfUnalignedTailIsTruncated) {
  testing::AlignedBuffer buf;
  ASSERT_TRUE(write_pattern(dir_.file("tail"), 5000, Feature::kOff, buf).ok());
  auto f = File::open_read(dir_.file("tail"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  auto got = zero_buffer(8192);
  IoRequest req{got.get(), 8192, 0};
  Status s = engine_->read(*f, {&req, 1}, kLong);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_EQ(s.offset().value_or(0), 5000u);
}

TEST_P(EngineTest, MisalignedDirectRequestIsInvalid) {
  auto f = File::create(dir_.file("m"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->direct());
  auto buf = pattern_buffer(3 * 4096, 1);
  IoRequest bad_buf{buf.get() + 1, 4096, 0};
  IoRequest bad_len{buf.get(), 4000, 0};
  IoRequest bad_off{buf.get(), 4096, 100};
  for (const IoRequest& r : {bad_buf, bad_len, bad_off}) {
    Status s = engine_->write(*f, {&r, 1}, kLong);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_EQ(s.path(), dir_.file("m"));
  }
}

TEST_P(EngineTest, TmpfsRoundTrip) {
  TempDir shm("/dev/shm");
  testing::AlignedBuffer buf;
  const uint64_t bytes = 1 << 20;
  Status s = write_pattern(shm.file("x"), bytes, Feature::kAuto, buf);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_file_equals(shm.file("x"), buf.get(), bytes, Feature::kAuto);
}

// ReadDone: each request's callback runs once, after all of its bytes are in (its buffer already
// holds the file's content when the callback looks), on the calling thread.
TEST_P(EngineTest, ReadDoneRunsOncePerRequestWithItsBytesIn) {
  testing::AlignedBuffer buf;
  const uint64_t bytes = 1 << 20;
  ASSERT_TRUE(write_pattern(dir_.file("cb"), bytes, Feature::kOn, buf).ok());
  auto f = File::open_read(dir_.file("cb"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  auto got = zero_buffer(bytes);
  // 7 requests of different sizes (several pieces of 64 KiB each, one empty), out of file order.
  const uint64_t cuts[] = {0, 4096, 69632, 200704, 200704, 528384, 790528, bytes};
  std::vector<IoRequest> reqs;
  for (size_t i = 0; i + 1 < std::size(cuts); ++i)
    reqs.push_back({got.get() + cuts[i], cuts[i + 1] - cuts[i], cuts[i]});
  std::reverse(reqs.begin(), reqs.end());
  std::vector<int> calls(reqs.size(), 0);
  const auto caller = std::this_thread::get_id();
  Status s = engine_->read(*f, reqs, kLong, [&](size_t i) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    ++calls.at(i);
    const IoRequest& r = reqs[i];
    EXPECT_EQ(std::memcmp(r.buf, buf.get() + r.offset, r.len), 0) << "request " << i;
    return ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(calls, std::vector<int>(reqs.size(), 1));
}

// A callback's error stops the read: no further callback, the error returned, nothing left in
// flight (the buffers may be freed at once).
TEST_P(EngineTest, ReadDoneErrorStopsTheRead) {
  testing::AlignedBuffer buf;
  const uint64_t bytes = 2 << 20;
  ASSERT_TRUE(write_pattern(dir_.file("cbe"), bytes, Feature::kOn, buf).ok());
  auto f = File::open_read(dir_.file("cbe"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  auto got = zero_buffer(bytes);
  std::vector<IoRequest> reqs;
  for (uint64_t off = 0; off < bytes; off += 64 << 10)
    reqs.push_back({got.get() + off, 64 << 10, off});
  int calls = 0;
  Status s = engine_->read(*f, reqs, kLong, [&](size_t) {
    ++calls;
    return Status(StatusCode::kCorrupt, "checksum mismatch");
  });
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_EQ(calls, 1);
}

// A failed transfer is the read's error; requests completed before it may have had their
// callbacks, the failed one never.
TEST_P(EngineTest, ReadDoneNotCalledForAFailedRequest) {
  testing::AlignedBuffer buf;
  ASSERT_TRUE(write_pattern(dir_.file("cbf"), 1 << 18, Feature::kOn, buf).ok());
  std::atomic<int> reads{0};
  ScopedFileHook hook(
      [&](FileOp op, const std::string&) { return op == FileOp::kRead && ++reads > 2 ? EIO : 0; });
  auto f = File::open_read(dir_.file("cbf"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  auto got = zero_buffer(1 << 18);
  std::vector<IoRequest> reqs;
  for (uint64_t off = 0; off < (1 << 18); off += 64 << 10)
    reqs.push_back({got.get() + off, 64 << 10, off});
  std::vector<size_t> called;
  Status s = engine_->read(*f, reqs, kLong, [&](size_t i) {
    called.push_back(i);
    return ok_status();
  });
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  EXPECT_LE(called.size(), 2u);
}

// A reader with `buffers` buffers: next() hands out the next 64 KiB of one of `files` (cycling)
// while a buffer is free, done() checks the bytes and frees the buffer.
class BufferedStream : public ReadStream {
 public:
  BufferedStream(std::vector<const File*> files, const std::byte* want, uint64_t bytes,
                 size_t buffers)
      : files_(std::move(files)),
        want_(want),
        bytes_(bytes),
        buf_(zero_buffer(buffers * kPiece)),
        busy_(buffers, -1) {}
  static constexpr uint64_t kPiece = 64 << 10;

  Result<bool> next(StreamRequest& out) override {
    if (fail_next_) return Status(StatusCode::kInternal, "next failed");
    if (offset_ >= bytes_ * files_.size()) return false;
    auto it = std::find(busy_.begin(), busy_.end(), -1);
    if (it == busy_.end()) return false;  // every buffer busy
    const size_t b = static_cast<size_t>(it - busy_.begin());
    *it = static_cast<int64_t>(offset_);
    const File* f = files_[offset_ / bytes_];
    out = StreamRequest{f, buf_.get() + b * kPiece, kPiece, offset_ % bytes_, b};
    offset_ += kPiece;
    ++issued_;
    return true;
  }
  Status done(uint64_t tag) override {
    const auto at = static_cast<uint64_t>(busy_.at(tag));
    EXPECT_EQ(std::memcmp(buf_.get() + tag * kPiece, want_ + at % bytes_, kPiece), 0) << at;
    busy_[tag] = -1;
    ++done_;
    if (fail_done_ && done_ == 2) return Status(StatusCode::kCorrupt, "checksum mismatch");
    return ok_status();
  }

  std::vector<const File*> files_;
  const std::byte* want_;
  uint64_t bytes_;
  testing::AlignedBuffer buf_;
  std::vector<int64_t> busy_;  // per buffer: the stream offset read into it, -1 free
  uint64_t offset_ = 0;
  int issued_ = 0, done_ = 0;
  bool fail_next_ = false, fail_done_ = false;
};

// read_stream reads what the stream supplies as it frees buffers, across files, each request's
// done() once with its bytes in, until the stream has nothing and nothing is in flight.
TEST_P(EngineTest, ReadStreamReadsWhatTheStreamSuppliesAsBuffersFree) {
  testing::AlignedBuffer buf;
  const uint64_t bytes = 1 << 20;
  ASSERT_TRUE(write_pattern(dir_.file("s1"), bytes, Feature::kOn, buf).ok());
  testing::AlignedBuffer same;
  ASSERT_TRUE(write_pattern(dir_.file("s2"), bytes, Feature::kOn, same).ok());
  auto a = File::open_read(dir_.file("s1"), Feature::kOn);
  auto b = File::open_read(dir_.file("s2"), Feature::kOn);
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t buffers : {1u, 3u, 8u}) {
    BufferedStream stream({&*a, &*b}, buf.get(), bytes, buffers);
    Status s = engine_->read_stream(stream, kLong);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(stream.issued_, static_cast<int>(2 * bytes / BufferedStream::kPiece));
    EXPECT_EQ(stream.done_, stream.issued_);
  }
}

// The first error stops the stream: done()'s, next()'s or a transfer's; no done() after it.
TEST_P(EngineTest, ReadStreamStopsAtTheFirstError) {
  testing::AlignedBuffer buf;
  const uint64_t bytes = 1 << 20;
  ASSERT_TRUE(write_pattern(dir_.file("se"), bytes, Feature::kOn, buf).ok());
  auto f = File::open_read(dir_.file("se"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  {
    BufferedStream stream({&*f}, buf.get(), bytes, 4);
    stream.fail_done_ = true;
    EXPECT_EQ(engine_->read_stream(stream, kLong).code(), StatusCode::kCorrupt);
    EXPECT_EQ(stream.done_, 2);
  }
  {
    BufferedStream stream({&*f}, buf.get(), bytes, 4);
    stream.fail_next_ = true;
    EXPECT_EQ(engine_->read_stream(stream, kLong).code(), StatusCode::kInternal);
    EXPECT_EQ(stream.done_, 0);
  }
  {
    std::atomic<int> reads{0};
    ScopedFileHook hook([&](FileOp op, const std::string&) {
      return op == FileOp::kRead && ++reads > 3 ? EIO : 0;
    });
    BufferedStream stream({&*f}, buf.get(), bytes, 2);
    Status s = engine_->read_stream(stream, kLong);
    EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
    EXPECT_EQ(s.sys_errno(), EIO);
    EXPECT_LE(stream.done_, 3);
  }
}

// A request past the end of the file is truncated (kCorrupt), as in read().
TEST_P(EngineTest, ReadStreamPastTheEndIsTruncated) {
  testing::AlignedBuffer buf;
  ASSERT_TRUE(write_pattern(dir_.file("st"), 64 << 10, Feature::kOn, buf).ok());
  auto f = File::open_read(dir_.file("st"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  BufferedStream stream({&*f}, buf.get(), 256 << 10, 2);  // claims 256 KiB of a 64 KiB file
  EXPECT_EQ(engine_->read_stream(stream, kLong).code(), StatusCode::kCorrupt);
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineTest, ::testing::Values("io_uring", "threads"),
                         [](const auto& info) {
                           return std::string(info.param) == "io_uring" ? std::string("uring")
                                                                        : std::string("threads");
                         });

TEST(UringEngine, RegisteredBuffersAreUsed) {
  auto e = IoEngine::create(small_options(Feature::kOn));
  if (!e.ok()) GTEST_SKIP() << e.status().to_string();
  auto* uring = dynamic_cast<detail::UringEngine*>(e->get());
  ASSERT_NE(uring, nullptr);
  TempDir dir;
  const uint64_t bytes = 1 << 20;
  auto buf = pattern_buffer(bytes, 3);
  iovec iov{buf.get(), bytes};
  Status reg = uring->register_buffers({&iov, 1});
  if (!reg.ok()) GTEST_SKIP() << "kernel refused registration: " << reg.to_string();
  auto f = File::create(dir.file("fixed"), Feature::kOn);
  ASSERT_TRUE(f.ok());
  IoRequest req{buf.get(), bytes, 0};
  ASSERT_TRUE(uring->write(*f, {&req, 1}, kLong).ok());
  EXPECT_EQ(uring->fixed_submissions(), bytes / (64 << 10));
  auto back = File::open_read(dir.file("fixed"), Feature::kOn);
  auto got = zero_buffer(bytes);
  IoRequest rd{got.get(), bytes, 0};
  ASSERT_TRUE(uring->read(*back, {&rd, 1}, kLong).ok());  // unregistered: normal opcodes
  EXPECT_EQ(uring->fixed_submissions(), bytes / (64 << 10));
  EXPECT_EQ(std::memcmp(got.get(), buf.get(), bytes), 0);
  EXPECT_TRUE(uring->register_buffers({}).ok());
}

TEST(IoEngineCreate, UringOffGivesThreads) {
  auto e = IoEngine::create(small_options(Feature::kOff));
  ASSERT_TRUE(e.ok());
  EXPECT_STREQ((*e)->name(), "threads");
  EXPECT_TRUE((*e)->register_buffers({}).ok());
}

class RefusedRing : public ::testing::TestWithParam<int> {
 protected:
  static int refuse(unsigned, io_uring*, unsigned) { return -errno_; }
  void SetUp() override {
    errno_ = GetParam();
    detail::set_ring_init_for_testing(&refuse);
  }
  void TearDown() override { detail::set_ring_init_for_testing(nullptr); }
  static inline int errno_ = 0;
};

TEST_P(RefusedRing, AutoFallsBackToThreadsAndOnIsAnError) {
  auto e = IoEngine::create(small_options(Feature::kAuto));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_STREQ((*e)->name(), "threads");
  TempDir dir;
  auto f = File::create(dir.file("f"), Feature::kAuto);
  auto buf = pattern_buffer(1 << 16, 2);
  IoRequest req{buf.get(), 1 << 16, 0};
  EXPECT_TRUE((*e)->write(*f, {&req, 1}, kLong).ok());
  auto on = IoEngine::create(small_options(Feature::kOn));
  EXPECT_EQ(on.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(on.status().sys_errno(), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Errnos, RefusedRing, ::testing::Values(ENOSYS, EPERM, ENOMEM));

TEST(IoEngineCreate, InvalidOptionsRejected) {
  IoOptions o = small_options(Feature::kAuto);
  o.request_bytes = 1000;
  EXPECT_EQ(IoEngine::create(o).status().code(), StatusCode::kInvalidArgument);
  o = small_options(Feature::kAuto);
  o.request_bytes = 0;
  EXPECT_FALSE(o.validate().ok());
  o = small_options(Feature::kAuto);
  o.queue_depth = 0;
  EXPECT_FALSE(o.validate().ok());
  o.queue_depth = 5000;
  EXPECT_FALSE(o.validate().ok());
  o = small_options(Feature::kAuto);
  o.threads = 0;
  EXPECT_FALSE(o.validate().ok());
  EXPECT_TRUE(small_options(Feature::kAuto).validate().ok());
}

TEST(IoOptions, FromEnv) {
  ::setenv("RESILIENT_IO_URING", "off", 1);
  ::setenv("RESILIENT_O_DIRECT", "on", 1);
  ::setenv("RESILIENT_IO_REQUEST_BYTES", "4MiB", 1);
  ::setenv("RESILIENT_IO_QUEUE_DEPTH", "32", 1);
  ::setenv("RESILIENT_IO_THREADS", "2", 1);
  IoOptions o = IoOptions::from_env().value();
  EXPECT_EQ(o.uring, Feature::kOff);
  EXPECT_EQ(o.direct, Feature::kOn);
  EXPECT_EQ(o.request_bytes, 4u << 20);
  EXPECT_EQ(o.queue_depth, 32);
  EXPECT_EQ(o.threads, 2);
  ::setenv("RESILIENT_IO_QUEUE_DEPTH", "lots", 1);
  auto bad = IoOptions::from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("RESILIENT_IO_QUEUE_DEPTH='lots'"), std::string::npos)
      << bad.status().message();
  ::setenv("RESILIENT_IO_QUEUE_DEPTH", "0", 1);  // well spelled, out of range: validate()
  EXPECT_FALSE(IoOptions::from_env().ok());
  for (const char* v : {"RESILIENT_IO_URING", "RESILIENT_O_DIRECT", "RESILIENT_IO_REQUEST_BYTES",
                        "RESILIENT_IO_QUEUE_DEPTH", "RESILIENT_IO_THREADS"}) {
    ::unsetenv(v);
  }
  IoOptions d = IoOptions::from_env().value();
  EXPECT_EQ(d.request_bytes, 16u << 20);
  EXPECT_EQ(d.queue_depth, 8);
}

}  // namespace
}  // namespace resilient::io
