#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <random>
#include <thread>

#include "io_test_util.hpp"
#include "resilient/checkpoint/checkpointer.hpp"
#include "resilient/checkpoint/commit.hpp"
#include "resilient/checkpoint/persist.hpp"
#include "resilient/io/file_hooks.hpp"
#include "resilient/memory/populate.hpp"

namespace resilient::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("resilient-ckpt-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::unique_ptr<Checkpointer> make(int zstd = 0, int keep = 3, int files = 1, int rank = 0,
                                     int world = 1) {
    auto o = CheckpointOptions::from_env(root_.string()).value();
    o.keep = keep;
    o.zstd_level = zstd;
    o.files_per_rank = files;
    o.rank = rank;
    o.world_size = world;
    o.chunk_bytes = 64 << 10;  // small chunks: many chunks per tensor
    o.pool.slab_bytes = 256 << 10;
    o.pool.budget_bytes = 64 << 20;
    o.timeout = 30s;
    auto c = Checkpointer::create(o);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return std::move(c).value();
  }

  // Two tensors: one spanning several chunks and slabs, one tiny; values depend on `seed`.
  void fill(uint32_t seed) {
    big_.resize(300'000);
    std::iota(big_.begin(), big_.end(), static_cast<float>(seed));
    small_ = {static_cast<int64_t>(seed), -1, 7};
  }
  std::vector<TensorSpec> specs() {
    return {TensorSpec{"big", "float32", {300'000}, big_.data(), big_.size() * 4},
            TensorSpec{"small", "int64", {3}, small_.data(), 24}};
  }
  Status save(Checkpointer& c, int64_t step) {
    auto h = c.save(step, specs(), {{"step", step}});
    if (!h.ok()) return h.status();
    return (*h)->wait(30s);
  }
  // Fills the tensors with `seed`'s values and saves them as step 1 through `c`: its manifest
  // in `m` (call under ASSERT_NO_FATAL_FAILURE).
  void save_step_one(Checkpointer& c, uint32_t seed, Manifest& m) {
    fill(seed);
    ASSERT_TRUE(save(c, 1).ok());
    auto got = c.manifest(1);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    m = std::move(got).value();
  }
  Status load_into(Checkpointer& c, int64_t step, std::vector<float>& big,
                   std::vector<int64_t>& small) {
    big.assign(300'000, 0);
    small.assign(3, 0);
    RESILIENT_ASSIGN_OR_RETURN(Manifest m, c.manifest(step));
    std::vector<ReadTarget> t = {{"big", big.data(), big.size() * 4}, {"small", small.data(), 24}};
    return c.read(m, t);
  }

  fs::path root_;
  std::vector<float> big_;
  std::vector<int64_t> small_;
};

TEST_F(EngineTest, SaveLoadRoundTripBitExact) {
  for (int zstd : {0, 3}) {
    fs::remove_all(root_);
    auto c = make(zstd);
    fill(11);
    ASSERT_TRUE(save(*c, 1).ok());
    fill(99);  // the caller's buffers change after save: the checkpoint keeps step-1 values
    std::vector<float> big;
    std::vector<int64_t> small;
    ASSERT_TRUE(load_into(*c, 1, big, small).ok());
    fill(11);
    EXPECT_EQ(big, big_) << "zstd=" << zstd;
    EXPECT_EQ(small, small_);
    auto m = c->manifest(1);
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(m->values["step"], 1);
    EXPECT_GT(m->tensors[0].chunks.size(), 4u);
    if (zstd) EXPECT_EQ(m->tensors[0].chunks[0].codec, Codec::kZstd);  // iota compresses
  }
}

// A target's done word is made odd once all its chunks are verified and in place: a thread that
// sees it odd (it may, while the call still runs) finds the whole tensor there. A damaged chunk
// leaves its tensor's word even; a word that is not 8-byte aligned is refused.
TEST_F(EngineTest, DoneWordsAreSetWhenATargetIsCompletelyInPlace) {
  auto c = make();
  Manifest m;
  ASSERT_NO_FATAL_FAILURE(save_step_one(*c, 5, m));
  std::vector<float> big(300'000, 0);
  std::vector<int64_t> small(3, 0);
  alignas(8) int64_t done[3] = {0, 0, 0};
  std::vector<ReadTarget> t = {{"big", big.data(), big.size() * 4, -1, &done[0]},
                               {"small", small.data(), 24, -1, &done[1]}};
  std::atomic<bool> seen_whole{false}, ended{false};
  std::thread watcher([&] {
    while ((std::atomic_ref<int64_t>(done[0]).load(std::memory_order_acquire) & 1) == 0) {
      if (ended) return;
      std::this_thread::yield();
    }
    seen_whole = big == big_;
  });
  Status read = c->read(m, t);
  ended = true;
  watcher.join();
  ASSERT_TRUE(read.ok()) << read.to_string();
  EXPECT_TRUE(seen_whole.load());
  EXPECT_EQ(done[0], 2 * static_cast<int64_t>(m.tensors[0].chunks.size()) + 1);
  EXPECT_EQ(done[1], 3);  // one chunk
  EXPECT_EQ(small, small_);

  io::testing::flip_byte((root_ / step_dir_name(1) / shard_file_name(0)).string(), 70'000);
  done[0] = done[1] = 0;
  EXPECT_EQ(c->read(m, t).code(), StatusCode::kCorrupt);
  EXPECT_EQ(done[0] & 1, 0);  // its damaged chunk never landed

  auto* odd = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(&done[1]) + 4);
  std::vector<ReadTarget> bad = {{"small", small.data(), 24, -1, odd}};
  EXPECT_EQ(c->read(m, bad).code(), StatusCode::kInvalidArgument);
}

// A populate target (a shared mapping whose pages do not exist yet: the shared restore's
// /dev/shm buffer) gets its pages before each chunk is written: the bytes land; a mapping whose
// pages cannot be had for writing fails the read with kResourceExhausted, not a signal.
TEST_F(EngineTest, PopulateTargetsGetTheirPagesBeforeTheyAreWritten) {
  auto c = make();
  Manifest m;
  ASSERT_NO_FATAL_FAILURE(save_step_one(*c, 5, m));
  const size_t bytes = big_.size() * 4;
  const int fd = memfd_create("populate-test", 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);  // sparse: no page yet
  // Three times the file: what follows it lies past its end, where a write raises SIGBUS, as on a
  // full tmpfs.
  void* rw = mmap(nullptr, 3 * bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(rw, MAP_FAILED);
  if (memory::populate_write(rw, 4096) == EINVAL) {
    munmap(rw, 3 * bytes);
    close(fd);
    GTEST_SKIP() << "no MADV_POPULATE_WRITE (Linux before 5.14)";
  }
  alignas(8) int64_t done = 0;
  std::vector<ReadTarget> t = {{"big", rw, bytes, -1, &done, /*populate=*/true}};
  Status read = c->read(m, t);
  ASSERT_TRUE(read.ok()) << read.to_string();
  EXPECT_EQ(done & 1, 1);
  EXPECT_EQ(std::memcmp(rw, big_.data(), bytes), 0);

  done = 0;  // past the end of the file: no page to be had
  const uint64_t page = 4096;
  t = {{"big", static_cast<std::byte*>(rw) + bytes / page * page + page, bytes, -1, &done, true}};
  read = c->read(m, t);
  EXPECT_EQ(read.code(), StatusCode::kResourceExhausted) << read.to_string();
  EXPECT_NE(read.to_string().find("in its shared mapping"), std::string::npos) << read.to_string();
  EXPECT_EQ(done & 1, 0);
  munmap(rw, 3 * bytes);

  void* ro = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(ro, MAP_FAILED);
  done = 0;
  t = {{"big", ro, bytes, -1, &done, /*populate=*/true}};
  read = c->read(m, t);
  EXPECT_EQ(read.code(), StatusCode::kResourceExhausted) << read.to_string();
  EXPECT_NE(read.to_string().find("'big'"), std::string::npos) << read.to_string();
  EXPECT_EQ(done & 1, 0);
  munmap(ro, bytes);
  close(fd);
}

// Readers sharing a queue (the ranks of a host, each with its own checkpointer and pool, here
// threads) read each chunk once between them into one buffer: every tensor whole, every done word
// odd, and the bytes they report adding up to the tensors' bytes.
TEST_F(EngineTest, ReadersSharingAQueueReadEachChunkOnceBetweenThem) {
  auto writer = make();
  Manifest m;
  ASSERT_NO_FATAL_FAILURE(save_step_one(*writer, 3, m));
  for (int round = 0; round < 20; ++round) {
    std::vector<float> big(big_.size(), 0);
    std::vector<int64_t> small(3, 0);
    alignas(8) int64_t done[2] = {0, 0};
    alignas(8) int64_t queue[2] = {0, 0};
    const std::vector<ReadTarget> t = {{"big", big.data(), big.size() * 4, -1, &done[0]},
                                       {"small", small.data(), 24, -1, &done[1]}};
    constexpr int kReaders = 4;
    std::vector<std::unique_ptr<Checkpointer>> readers;
    for (int r = 0; r < kReaders; ++r) readers.push_back(make());
    std::vector<uint64_t> bytes(kReaders, 0);
    std::vector<Status> status(kReaders);
    std::vector<std::thread> threads;
    for (int r = 0; r < kReaders; ++r) {
      threads.emplace_back([&, r] {
        status[r] =
            readers[r]->read(m, t, {.local_ranks = 1, .queue = queue, .bytes_read = &bytes[r]});
      });
    }
    for (auto& th : threads) th.join();
    for (const auto& s : status) ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(big, big_);
    EXPECT_EQ(small, small_);
    EXPECT_EQ(done[0], 2 * static_cast<int64_t>(m.tensors[0].chunks.size()) + 1);
    EXPECT_EQ(done[1], 3);
    EXPECT_EQ(std::accumulate(bytes.begin(), bytes.end(), uint64_t{0}), big.size() * 4 + 24);
    EXPECT_NE(queue[1], 0);  // the plan's fingerprint
  }
}

// A reader that finds the queue's first group claimed (by another process) reads the rest and
// leaves that group's tensor unfinished; one whose plan differs from the queue's reads nothing
// (and claims nothing: the others read it all); one that fails closes the queue, so the others
// stop claiming.
TEST_F(EngineTest, AQueueIsSharedOnlyByEqualPlansAndClosedByAFailure) {
  auto c = make();
  Manifest m;
  ASSERT_NO_FATAL_FAILURE(save_step_one(*c, 4, m));
  std::vector<float> big(big_.size(), 0);
  std::vector<int64_t> small(3, 0);
  alignas(8) int64_t done[2] = {0, 0};
  alignas(8) int64_t queue[2] = {1, 0};  // group 0 taken
  const std::vector<ReadTarget> t = {{"big", big.data(), big.size() * 4, -1, &done[0]},
                                     {"small", small.data(), 24, -1, &done[1]}};
  uint64_t bytes = 0;
  Status read = c->read(m, t, {.local_ranks = 1, .queue = queue, .bytes_read = &bytes});
  ASSERT_TRUE(read.ok()) << read.to_string();
  EXPECT_LT(bytes, big.size() * 4 + 24);
  EXPECT_GT(bytes, 0u);
  EXPECT_EQ(done[0] & 1, 0);  // its first chunks were another reader's
  EXPECT_NE(big, big_);
  const int64_t fingerprint = queue[1];
  ASSERT_NE(fingerprint, 0);

  auto o = c->options();  // larger slabs: other extents, another plan
  o.pool.slab_bytes = 1 << 20;
  auto other = Checkpointer::create(o);
  ASSERT_TRUE(other.ok());
  queue[0] = 0;
  done[0] = done[1] = 0;
  bytes = 1;
  read = (*other)->read(m, t, {.local_ranks = 1, .queue = queue, .bytes_read = &bytes});
  ASSERT_TRUE(read.ok()) << read.to_string();
  EXPECT_EQ(bytes, 0u);
  EXPECT_EQ(queue[0], 0);  // nothing claimed
  EXPECT_EQ(queue[1], fingerprint);
  EXPECT_EQ(done[0], 0);
  EXPECT_EQ(done[1], 0);

  io::testing::flip_byte((root_ / step_dir_name(1) / shard_file_name(0)).string(), 70'000);
  queue[0] = queue[1] = 0;
  read = c->read(m, t, {.local_ranks = 1, .queue = queue, .bytes_read = &bytes});
  EXPECT_EQ(read.code(), StatusCode::kCorrupt) << read.to_string();
  EXPECT_GE(queue[0], int64_t{1} << 62);
}

// The plan, and so the fingerprint a queue is shared under, depends on what is read and in
// which extents (the request size), not on the reader threads: ranks with other thread counts
// share the queue; a rank whose requests are cut otherwise plans apart and reads nothing.
TEST_F(EngineTest, ReadersPlanAlikeWhateverTheirThreadsButNotTheirRequestSize) {
  auto writer = make();
  Manifest m;
  ASSERT_NO_FATAL_FAILURE(save_step_one(*writer, 6, m));
  auto with = [&](int threads, uint64_t request_bytes) {
    auto o = writer->options();
    o.restore_threads = threads;
    o.io.request_bytes = request_bytes;
    return Checkpointer::create(o).value();
  };
  auto one = with(1, 64 << 10);
  auto four = with(4, 64 << 10);
  auto other_requests = with(4, 128 << 10);
  std::vector<float> big(big_.size(), 0);
  std::vector<int64_t> small(3, 0);
  const std::vector<ReadTarget> t = {{"big", big.data(), big.size() * 4},
                                     {"small", small.data(), 24}};
  const uint64_t all = big.size() * 4 + 24;
  for (Checkpointer* second_reader : {four.get(), other_requests.get()}) {
    alignas(8) int64_t queue[2] = {0, 0};
    uint64_t first = 0, second = 0;
    ASSERT_TRUE(one->read(m, t, {.queue = queue, .bytes_read = &first}).ok());
    queue[0] = 0;  // the extents again, under the first reader's fingerprint
    ASSERT_TRUE(second_reader->read(m, t, {.queue = queue, .bytes_read = &second}).ok());
    EXPECT_EQ(first, all);
    EXPECT_EQ(second, second_reader == four.get() ? all : 0);
  }
  EXPECT_EQ(big, big_);
}

// close() frees the pool's slabs (a snapshot's worth of memory) once the saves are done; a
// checkpointer used again afterwards allocates anew.
TEST_F(EngineTest, CloseFreesThePoolAndASaveAfterItAllocatesAgain) {
  auto c = make();
  fill(5);
  ASSERT_TRUE(save(*c, 1).ok());
  EXPECT_GT(c->pool().allocated_bytes(), 0u);
  ASSERT_TRUE(c->close(30s).ok());
  EXPECT_EQ(c->pool().allocated_bytes(), 0u);
  ASSERT_TRUE(save(*c, 2).ok());
  auto m = c->manifest(2);
  ASSERT_TRUE(m.ok());
  std::vector<float> big(big_.size(), 0);
  std::vector<ReadTarget> t = {{"big", big.data(), big.size() * 4}};
  ASSERT_TRUE(c->read(*m, t).ok());
  EXPECT_EQ(big, big_);

  // A pool that another checkpointer shares stays: it is theirs too.
  auto shared = c->shared_pool();
  const uint64_t held = c->pool().allocated_bytes();
  ASSERT_GT(held, 0u);
  ASSERT_TRUE(c->close(30s).ok());
  EXPECT_EQ(shared->allocated_bytes(), held);
}

// save_json parses the values on the writer thread: the same checkpoint as save(); text that is
// not JSON fails that save on its handle and leaves the last checkpoint as it was.
TEST_F(EngineTest, ValuesAsJsonTextAreParsedByTheWriter) {
  auto c = make();
  fill(5);
  auto h = c->save_json(1, specs(), R"({"step": 1, "doc": [1, "x", null]})");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE((*h)->wait(30s).ok());
  auto m = c->manifest(1);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->values["step"], 1);
  EXPECT_EQ(m->values["doc"][1], "x");
  for (const char* bad : {"{\"step\": ", "not json", "{} trailing"}) {
    auto b = c->save_json(2, specs(), bad);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    Status s = (*b)->wait(30s);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad << ": " << s.to_string();
    EXPECT_NE(s.to_string().find("not valid JSON"), std::string::npos) << s.to_string();
  }
  auto steps = c->steps();
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(*steps, std::vector<int64_t>{1});
  auto empty = c->save_json(3, specs(), "");  // no values: an empty object
  ASSERT_TRUE(empty.ok());
  ASSERT_TRUE((*empty)->wait(30s).ok());
  EXPECT_TRUE(c->manifest(3)->values.empty());
}

// Restore reads consecutive extents in one call (as many as fill queue_depth x request_bytes),
// with several threads, and chunks larger than the reader's slabs into heap buffers: every
// combination restores the same bytes.
TEST_F(EngineTest, RestoreInGroupsOfExtentsAndWithSmallerSlabs) {
  struct Reader {
    uint64_t slab, request;
    int depth, threads;
    uint64_t budget = 64 << 20;
  };
  const Reader readers[] = {
      {256 << 10, 64 << 10, 4, 3},  // one extent per read
      {256 << 10, 64 << 10, 8, 2},  // two per read
      {256 << 10, 1 << 20, 8, 1},   // all in one read
      {16 << 10, 16 << 10, 2, 3},   // 64 KiB chunks in 16 KiB slabs: heap buffers, two per read
      // Budgets below threads x 2 x extents per read: fewer threads and extents, no waiting
      // for slabs another thread holds (a wait would end in the 5 s timeout).
      {256 << 10, 1 << 20, 8, 4, 256 << 10},
      {256 << 10, 1 << 20, 8, 4, 3 * (256 << 10)},
  };
  for (int zstd : {0, 3}) {
    fs::remove_all(root_);
    auto writer = make(zstd);
    fill(5);
    ASSERT_TRUE(save(*writer, 1).ok());
    for (const auto& r : readers) {
      auto o = CheckpointOptions::from_env(root_.string()).value();
      o.chunk_bytes = r.slab;  // a slab holds at least one chunk of this reader's own saves
      o.pool.slab_bytes = r.slab;
      o.pool.budget_bytes = r.budget;
      o.timeout = 5s;
      o.io.request_bytes = r.request;
      o.io.queue_depth = r.depth;
      o.restore_threads = r.threads;
      auto reader = Checkpointer::create(o);
      ASSERT_TRUE(reader.ok()) << reader.status().to_string();
      ASSERT_EQ((*reader)->pool().slab_bytes(), r.slab);
      std::vector<float> big;
      std::vector<int64_t> small;
      Status s = load_into(**reader, 1, big, small);
      ASSERT_TRUE(s.ok()) << s.to_string() << " slab " << r.slab << " zstd " << zstd;
      EXPECT_EQ(big, big_) << "slab " << r.slab << " request " << r.request << " depth " << r.depth
                           << " budget " << r.budget;
      EXPECT_EQ(small, small_);
    }
  }
}

TEST_F(EngineTest, RetentionKeepsNewest) {
  auto c = make(0, /*keep=*/2);
  fill(1);
  for (int s = 1; s <= 4; ++s) ASSERT_TRUE(save(*c, s * 10).ok());
  ASSERT_TRUE(c->wait_all(30s).ok());  // retention runs after the handle completes
  auto steps = c->steps();
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(*steps, (std::vector<int64_t>{30, 40}));
  EXPECT_EQ(read_latest(root_.string()), 40);
}

TEST_F(EngineTest, ResavingAStepReplacesItAtomically) {
  auto c = make();
  fill(1);
  ASSERT_TRUE(save(*c, 5).ok());
  fill(2);
  ASSERT_TRUE(save(*c, 5).ok());
  std::vector<float> big;
  std::vector<int64_t> small;
  ASSERT_TRUE(load_into(*c, 5, big, small).ok());
  EXPECT_EQ(small[0], 2);
}

TEST_F(EngineTest, FlippedByteIsCorruptNamingFileAndOffset) {
  auto c = make();
  fill(3);
  ASSERT_TRUE(save(*c, 1).ok());
  fs::path data = root_ / step_dir_name(1) / shard_file_name(0);
  io::testing::flip_byte(data.string(), 70'000);
  std::vector<float> big;
  std::vector<int64_t> small;
  Status s = load_into(*c, 1, big, small);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_EQ(s.path(), data.string());
  ASSERT_TRUE(s.offset().has_value());
  EXPECT_LE(*s.offset(), 70'000u);
  auto m = c->manifest(1);
  EXPECT_EQ(c->verify(*m).code(), StatusCode::kCorrupt);
}

TEST_F(EngineTest, TruncatedAndMissingShardsAreErrors) {
  auto c = make();
  fill(3);
  ASSERT_TRUE(save(*c, 1).ok());
  fs::path data = root_ / step_dir_name(1) / shard_file_name(0);
  fs::resize_file(data, 100'000);
  std::vector<float> big;
  std::vector<int64_t> small;
  Status s = load_into(*c, 1, big, small);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_NE(s.message().find("truncated"), std::string::npos);
  fs::remove(data);
  s = load_into(*c, 1, big, small);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
}

TEST_F(EngineTest, TargetSizeMismatchAndUnknownTensor) {
  auto c = make();
  fill(3);
  ASSERT_TRUE(save(*c, 1).ok());
  auto m = c->manifest(1);
  std::vector<float> wrong(10);
  std::vector<ReadTarget> t = {{"big", wrong.data(), 40}};
  EXPECT_EQ(c->read(*m, t).code(), StatusCode::kInvalidArgument);
  t = {{"nope", wrong.data(), 40}};
  EXPECT_EQ(c->read(*m, t).code(), StatusCode::kNotFound);
}

// ENOSPC / EIO / failing fsync or rename during a save: the error reaches wait(), the previous
// checkpoint stays loadable, no partial step is committed, and later saves work again.
TEST_F(EngineTest, WriteFailuresLeaveThePreviousCheckpointIntact) {
  struct Case {
    io::FileOp op;
    int err;
    StatusCode code;
  };
  for (Case k : {Case{io::FileOp::kWrite, ENOSPC, StatusCode::kNoSpace},
                 Case{io::FileOp::kWrite, EIO, StatusCode::kIoError},
                 Case{io::FileOp::kFsync, EIO, StatusCode::kIoError},
                 Case{io::FileOp::kRename, EIO, StatusCode::kIoError}}) {
    fs::remove_all(root_);
    auto c = make();
    fill(1);
    ASSERT_TRUE(save(*c, 1).ok());
    {
      io::ScopedFileHook hook([&](io::FileOp op, const std::string& path) {
        return (op == k.op && path.find(root_.string()) == 0) ? k.err : 0;
      });
      fill(2);
      Status s = save(*c, 2);
      EXPECT_EQ(s.code(), k.code) << io::file_op_name(k.op) << ": " << s.to_string();
    }
    auto steps = c->steps();
    EXPECT_EQ(*steps, std::vector<int64_t>{1}) << io::file_op_name(k.op);
    EXPECT_FALSE(fs::exists(tmp_dir_path(root_.string(), 2)))
        << "failed save leaves no temporary directory";
    std::vector<float> big;
    std::vector<int64_t> small;
    ASSERT_TRUE(load_into(*c, 1, big, small).ok());
    EXPECT_EQ(small[0], 1);
    fill(3);
    EXPECT_TRUE(save(*c, 3).ok()) << "saves work again after the fault clears";
  }
}

TEST_F(EngineTest, ShortWritesAreCompleted) {
  auto c = make();
  fill(5);
  int calls = 0;
  {
    io::ScopedFileHook hook([&](io::FileOp op, const std::string& path) {
      return (op == io::FileOp::kWrite && ++calls % 2 == 1) ? -4096 : 0;
    });
    ASSERT_TRUE(save(*c, 1).ok());
  }
  EXPECT_GT(calls, 1);
  std::vector<float> big;
  std::vector<int64_t> small;
  ASSERT_TRUE(load_into(*c, 1, big, small).ok());
  EXPECT_EQ(big, big_);
}

TEST_F(EngineTest, StaleTemporaryDirectoryIsNotACheckpoint) {
  auto c = make();
  fill(1);
  ASSERT_TRUE(save(*c, 1).ok());
  // A crash during a save of step 2 leaves .tmp-step-2 with data and even a manifest.
  fs::create_directories(tmp_dir_path(root_.string(), 2));
  fs::copy(root_ / step_dir_name(1) / kManifestName,
           fs::path(tmp_dir_path(root_.string(), 2)) / kManifestName);
  EXPECT_EQ(*c->steps(), std::vector<int64_t>{1});
  fill(2);
  ASSERT_TRUE(save(*c, 2).ok());  // the stale directory is replaced
  EXPECT_EQ(*c->steps(), (std::vector<int64_t>{1, 2}));
}

TEST_F(EngineTest, BudgetTooSmallIsResourceExhausted) {
  auto o = CheckpointOptions::from_env(root_.string()).value();
  o.chunk_bytes = 64 << 10;
  o.pool.slab_bytes = 256 << 10;
  o.pool.budget_bytes = 512 << 10;
  auto c = Checkpointer::create(o);
  ASSERT_TRUE(c.ok());
  fill(1);
  auto h = (*c)->save(1, specs(), {});
  EXPECT_EQ(h.status().code(), StatusCode::kResourceExhausted);
}

TEST_F(EngineTest, InvalidSpecsAreRejected) {
  auto c = make();
  fill(1);
  auto s = specs();
  s[1].name = "big";
  EXPECT_EQ(c->save(1, s, {}).status().code(), StatusCode::kInvalidArgument);
  s = specs();
  s[0].nbytes = 12;
  EXPECT_EQ(c->save(1, s, {}).status().code(), StatusCode::kInvalidArgument);
  s = specs();
  s[0].dtype = "float7";
  EXPECT_EQ(c->save(1, s, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->save(-1, specs(), {}).status().code(), StatusCode::kInvalidArgument);
}

// Small tensors are packed (a state of many costs its payload, not 4 KiB each), round-trip
// bit-exact with and without compression, and a flipped bit anywhere in their bytes is caught
// by its chunk's checksum.
TEST_F(EngineTest, PackedSmallTensorsRoundTripAndEveryFlippedBitIsCaught) {
  const char* dtypes[] = {"uint8", "float16", "float32", "float64", "complex128"};
  std::mt19937 gen(7);
  std::vector<std::vector<std::byte>> data;
  std::vector<TensorSpec> specs;
  uint64_t payload = 0;
  for (int i = 0; i < 300; ++i) {
    const std::string dtype = dtypes[i % 5];
    const int64_t n = 1 + i % 7;
    const uint64_t nbytes = n * dtype_size(dtype);
    auto& d = data.emplace_back(nbytes);
    for (auto& b : d) b = std::byte(gen());
    specs.push_back(TensorSpec{"t" + std::to_string(i), dtype, {n}, d.data(), nbytes});
    payload += nbytes;
    if (i == 100) {  // a large tensor among them starts on a 4 KiB boundary
      fill(1);
      specs.push_back(TensorSpec{"big", "float32", {300'000}, big_.data(), big_.size() * 4});
    }
  }
  for (int zstd : {0, 3}) {
    fs::remove_all(root_);
    auto c = make(zstd);
    auto h = c->save(1, specs, {});
    ASSERT_TRUE(h.ok() && (*h)->wait(30s).ok());
    auto m = c->manifest(1);
    ASSERT_TRUE(m.ok());
    for (const auto& t : m->tensors) {
      if (t.name == "big" && zstd == 0) EXPECT_EQ(t.chunks[0].offset % 4096, 0u);
    }
    const uint64_t size = fs::file_size(root_ / step_dir_name(1) / shard_file_name(0));
    EXPECT_LE(size, payload + big_.size() * 4 + 3 * 4096) << "zstd " << zstd;
    std::vector<std::vector<std::byte>> got;
    std::vector<ReadTarget> targets;
    for (const auto& sp : specs) {
      got.emplace_back(sp.nbytes);
      targets.push_back({sp.name, got.back().data(), sp.nbytes});
    }
    Status s = c->read(*m, targets);
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_EQ(std::memcmp(got[i].data(), specs[i].data, specs[i].nbytes), 0) << specs[i].name;
    }
  }
  // Every byte of 40 packed tensors (one bit each, all eight positions in turn): corrupt, at
  // the offset of the chunk that holds it.
  fs::remove_all(root_);
  specs.resize(40);
  auto c = make();
  auto h = c->save(1, specs, {});
  ASSERT_TRUE(h.ok() && (*h)->wait(30s).ok());
  auto m = c->manifest(1);
  ASSERT_TRUE(m.ok());
  const std::string path = (root_ / step_dir_name(1) / shard_file_name(0)).string();
  auto flip = [&](uint64_t at, int bit) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    char b = 0;
    f.seekg(static_cast<std::streamoff>(at));
    f.read(&b, 1);
    b = static_cast<char>(b ^ (1 << bit));
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&b, 1);
    ASSERT_TRUE(f.good());
  };
  ASSERT_TRUE(c->verify(*m).ok());
  int flips = 0;
  for (const auto& t : m->tensors) {
    for (const auto& ch : t.chunks) {
      for (uint64_t at = ch.offset; at < ch.offset + ch.len; ++at, ++flips) {
        flip(at, flips % 8);
        Status v = c->verify(*m);
        flip(at, flips % 8);
        ASSERT_EQ(v.code(), StatusCode::kCorrupt) << t.name << " byte " << at;
        EXPECT_EQ(v.offset(), ch.offset);
      }
    }
  }
  EXPECT_GT(flips, 200);
  EXPECT_TRUE(c->verify(*m).ok());
}

// A step directory replaced by a symbolic link (to /etc, or to a copy of a real step) is not
// listed and not read: load falls back to the previous step.
TEST_F(EngineTest, SymlinkedStepDirectoryIsRefusedNotFollowed) {
  auto c = make(0, /*keep=*/5);
  fill(1);
  ASSERT_TRUE(save(*c, 1).ok());
  fill(2);
  ASSERT_TRUE(save(*c, 2).ok());
  auto m2 = c->manifest(2);
  ASSERT_TRUE(m2.ok());
  const fs::path step2 = root_ / step_dir_name(2);
  const fs::path elsewhere = root_.string() + "-elsewhere";
  fs::remove_all(elsewhere);
  fs::rename(step2, elsewhere);  // the right bytes, outside the root
  fs::create_directory_symlink(elsewhere, step2);
  EXPECT_EQ(*c->steps(), std::vector<int64_t>{1});
  auto m = c->manifest(2);
  EXPECT_EQ(m.status().code(), StatusCode::kCorrupt) << m.status().to_string();
  EXPECT_NE(m.status().message().find("symbolic link"), std::string::npos);
  EXPECT_EQ(m.status().path(), step2.string());
  std::vector<float> big(300'000);
  std::vector<int64_t> small(3);
  std::vector<ReadTarget> t = {{"big", big.data(), big.size() * 4}, {"small", small.data(), 24}};
  EXPECT_EQ(c->read(*m2, t).code(), StatusCode::kCorrupt);
  EXPECT_EQ(c->verify(*m2).code(), StatusCode::kCorrupt);
  ASSERT_TRUE(load_into(*c, 1, big, small).ok());
  EXPECT_EQ(small[0], 1);
  fs::remove(step2);
  fs::create_directory_symlink("/etc", step2);
  EXPECT_EQ(*c->steps(), std::vector<int64_t>{1});
  EXPECT_EQ(c->manifest(2).status().code(), StatusCode::kCorrupt);
  fs::remove(step2);
  fs::remove_all(elsewhere);
}

// A save's temporary directory replaced by a symbolic link: a shard save (commit=false, the
// ranks share the directory) fails with a clear error and writes nothing through it; a
// committing save replaces the link with a directory of its own.
TEST_F(EngineTest, SymlinkedTemporaryDirectoryIsNeverWrittenThrough) {
  auto c = make();
  fill(1);
  ASSERT_TRUE(save(*c, 1).ok());
  const fs::path victim = root_.string() + "-victim";
  fs::remove_all(victim);
  fs::create_directories(victim);
  fs::create_directory_symlink(victim, tmp_dir_path(root_.string(), 2));
  auto h = c->save(2, specs(), {}, /*commit=*/false);
  ASSERT_TRUE(h.ok());
  Status s = (*h)->wait(30s);
  EXPECT_EQ(s.sys_errno(), ELOOP) << s.to_string();
  EXPECT_NE(s.to_string().find("symbolic link"), std::string::npos) << s.to_string();
  EXPECT_NE(s.to_string().find(tmp_dir_name(2)), std::string::npos) << s.to_string();
  EXPECT_TRUE(fs::is_empty(victim));
  fs::remove(tmp_dir_path(root_.string(), 2));
  fs::create_directory_symlink(victim, tmp_dir_path(root_.string(), 2));
  ASSERT_TRUE(save(*c, 2).ok());
  EXPECT_TRUE(fs::is_empty(victim));
  EXPECT_EQ(*c->steps(), (std::vector<int64_t>{1, 2}));
  fs::remove_all(victim);
}

// files_per_rank > 1: the image is cut at large tensors into several data files written at once;
// loads (by a reader of any files_per_rank) are bit-exact; a flipped byte or a truncation in a
// further file is an error naming that file; a rank's files merge in commit_shards.
class MultiFileTest : public EngineTest {
 protected:
  std::unique_ptr<Checkpointer> make_files(int files, int rank = 0, int world = 1) {
    return make(0, 3, files, rank, world);
  }
  // Large tensors of several sizes (one spans slabs) between small ones, rank-dependent names.
  void fill_many(uint32_t seed, int rank = 0) {
    const size_t sizes[] = {5, 200'000, 7, 50'000, 100'000, 3, 70'000, 120'000};
    data_.clear();
    specs_.clear();
    for (size_t i = 0; i < std::size(sizes); ++i) {
      std::vector<float> v(sizes[i]);
      std::iota(v.begin(), v.end(), static_cast<float>(seed + 1000 * i));
      data_.push_back(std::move(v));
    }
    for (size_t i = 0; i < data_.size(); ++i) {
      specs_.push_back(TensorSpec{"r" + std::to_string(rank) + "/t" + std::to_string(i),
                                  "float32",
                                  {static_cast<int64_t>(data_[i].size())},
                                  data_[i].data(),
                                  data_[i].size() * 4});
    }
  }
  Status load_all(Checkpointer& c, int64_t step, std::vector<std::vector<float>>& out) {
    RESILIENT_ASSIGN_OR_RETURN(Manifest m, c.manifest(step));
    out.clear();
    std::vector<ReadTarget> targets;
    for (const auto& s : specs_) out.emplace_back(s.nbytes / 4, -1.0f);
    for (size_t i = 0; i < specs_.size(); ++i)
      targets.push_back({specs_[i].name, out[i].data(), specs_[i].nbytes});
    return c.read(m, targets);
  }
  std::vector<std::vector<float>> data_;
  std::vector<TensorSpec> specs_;
};

TEST_F(MultiFileTest, PlanCutsAtLargeTensorsNearEvenShares) {
  fill_many(0);
  auto layout = plan_layout(specs_, 256 << 10, 64 << 10);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  for (size_t files : {1, 2, 3, 4, 8, 20}) {
    auto cuts = plan_file_cuts(*layout, files);
    ASSERT_GE(cuts.size(), 2u);
    EXPECT_LE(cuts.size() - 1, files);
    EXPECT_EQ(cuts.front(), 0u);
    EXPECT_EQ(cuts.back(), layout->bytes);
    for (size_t i = 1; i + 1 < cuts.size(); ++i) {
      EXPECT_GT(cuts[i], cuts[i - 1]);
      EXPECT_EQ(cuts[i] % 4096, 0u);
      bool starts_a_tensor = false;
      for (const auto& t : layout->tensors)
        starts_a_tensor |= !t.chunks.empty() && t.chunks.front().offset == cuts[i];
      EXPECT_TRUE(starts_a_tensor) << cuts[i];
    }
  }
  EXPECT_EQ(plan_file_cuts(*layout, 1).size(), 2u);
  EXPECT_EQ(plan_file_cuts(*layout, 4).size(), 5u);   // five large tensors: four files
  EXPECT_EQ(plan_file_cuts(*layout, 20).size(), 7u);  // a cut at each large tensor, no more
}

// Cuts go to the large tensor nearest each even share, not the first one past it: 8 equal
// tensors and a small tail make 8 equal files; 450 + 550 KiB make 2 files (found in review:
// "first start at or past i/n" gave 7 files with file 0 twice the others, and 1 file).
TEST_F(MultiFileTest, PlanCutsPickTheNearestTensorToEachShare) {
  auto specs_of = [](const std::vector<uint64_t>& sizes) {
    std::vector<TensorSpec> out;
    for (size_t i = 0; i < sizes.size(); ++i) {
      TensorSpec t;
      t.name = "t" + std::to_string(i);
      t.dtype = "uint8";
      t.shape = {static_cast<int64_t>(sizes[i])};
      t.nbytes = sizes[i];
      t.data = &t;  // never read: plan_layout only refuses null data
      out.push_back(std::move(t));
    }
    return out;
  };
  const uint64_t s = 512 << 10;
  auto eight = plan_layout(specs_of({s, s, s, s, s, s, s, s, 8}), 256 << 10, 64 << 10);
  ASSERT_TRUE(eight.ok());
  auto cuts = plan_file_cuts(*eight, 8);
  ASSERT_EQ(cuts.size(), 9u);
  for (size_t i = 1; i < 8; ++i) EXPECT_EQ(cuts[i], i * s);
  auto two = plan_layout(specs_of({450 << 10, 550 << 10}), 256 << 10, 64 << 10);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(plan_file_cuts(*two, 2),
            (std::vector<uint64_t>{0, two->tensors[1].chunks.front().offset, two->bytes}));
}

// Random states (sizes around the packing threshold and the slab size, dtypes of 1-8 bytes)
// and file counts: the cuts keep their invariants and every save loads back bit for bit.
TEST_F(MultiFileTest, RandomStatesAndFileCountsRoundTrip) {
  std::mt19937 gen(11);
  const char* dtypes[] = {"uint8", "float16", "float32", "int64"};
  const size_t esizes[] = {1, 2, 4, 8};
  for (int round = 0; round < 12; ++round) {
    fs::remove_all(root_);
    const int files = 1 + static_cast<int>(gen() % 9);
    auto c = make_files(files);
    std::vector<std::vector<std::byte>> bytes;
    specs_.clear();
    const int n = 1 + static_cast<int>(gen() % 12);
    for (int i = 0; i < n; ++i) {
      const size_t d = gen() % 4;
      const uint64_t pick[] = {1, 4095, 64 << 10, (64 << 10) + 3, 300 << 10, 600 << 10};
      uint64_t nbytes = pick[gen() % 6] + gen() % 9000;
      nbytes -= nbytes % esizes[d];
      if (nbytes == 0) nbytes = esizes[d];
      std::vector<std::byte> b(nbytes);
      for (auto& x : b) x = static_cast<std::byte>(gen());
      bytes.push_back(std::move(b));
      TensorSpec t;
      t.name = "t" + std::to_string(i);
      t.dtype = dtypes[d];
      t.shape = {static_cast<int64_t>(nbytes / esizes[d])};
      t.data = bytes.back().data();
      t.nbytes = nbytes;
      specs_.push_back(std::move(t));
    }
    auto layout = plan_layout(specs_, 256 << 10, 64 << 10);
    ASSERT_TRUE(layout.ok());
    auto cuts = plan_file_cuts(*layout, files);
    ASSERT_LE(cuts.size() - 1, static_cast<size_t>(files));
    for (size_t i = 1; i < cuts.size(); ++i) ASSERT_GT(cuts[i], cuts[i - 1]) << round;
    auto h = c->save(1, specs_, {});
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE((*h)->wait(30s).ok()) << round;
    auto m = c->manifest(1);
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(m->shards.size(), cuts.size() - 1) << round;
    std::vector<std::vector<std::byte>> got;
    std::vector<ReadTarget> targets;
    for (const auto& s : specs_) got.emplace_back(s.nbytes, std::byte{0xAB});
    for (size_t i = 0; i < specs_.size(); ++i)
      targets.push_back({specs_[i].name, got[i].data(), specs_[i].nbytes});
    ASSERT_TRUE(c->read(*m, targets).ok()) << round;
    EXPECT_EQ(got, bytes) << "round " << round << " files " << files;
  }
}

TEST_F(MultiFileTest, SavesSeveralFilesAndLoadsBitExact) {
  auto c = make_files(4);
  fill_many(3);
  auto h = c->save(1, specs_, {{"step", 1}});
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE((*h)->wait(30s).ok());
  auto m = c->manifest(1);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  ASSERT_EQ(m->shards.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(m->shards[i].file, shard_file_name(0, i));
    EXPECT_EQ(fs::file_size(root_ / step_dir_name(1) / shard_file_name(0, i)), m->shards[i].bytes);
  }
  std::vector<std::vector<float>> got;
  ASSERT_TRUE(load_all(*c, 1, got).ok());
  EXPECT_EQ(got, data_);
  auto single = make_files(1);  // a reader's own files_per_rank does not matter
  ASSERT_TRUE(load_all(*single, 1, got).ok());
  EXPECT_EQ(got, data_);
  EXPECT_TRUE(c->verify(*m).ok());
  // A later save into the same pool (slabs released by several writers) is bit-exact too.
  fill_many(9);
  ASSERT_TRUE((*c->save(2, specs_, {}))->wait(30s).ok());
  ASSERT_TRUE(load_all(*c, 2, got).ok());
  EXPECT_EQ(got, data_);
}

TEST_F(MultiFileTest, DamageInAFurtherFileNamesIt) {
  auto c = make_files(4);
  fill_many(5);
  ASSERT_TRUE((*c->save(1, specs_, {}))->wait(30s).ok());
  const fs::path third = root_ / step_dir_name(1) / shard_file_name(0, 2);
  io::testing::flip_byte(third.string(), 4096 + 10);
  std::vector<std::vector<float>> got;
  Status s = load_all(*c, 1, got);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_EQ(s.path(), third.string());
  fs::resize_file(third, 4096);
  s = load_all(*c, 1, got);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.to_string();
}

TEST_F(MultiFileTest, AFailedWriteOfOneFileFailsTheSaveAndKeepsThePrevious) {
  for (int err : {ENOSPC, EIO}) {
    fs::remove_all(root_);
    auto c = make_files(4);
    fill_many(1);
    ASSERT_TRUE((*c->save(1, specs_, {}))->wait(30s).ok());
    const std::string victim = shard_file_name(0, 3);
    {
      io::ScopedFileHook hook([&](io::FileOp op, const std::string& path) {
        return (op == io::FileOp::kWrite && path.find(victim) != std::string::npos) ? err : 0;
      });
      fill_many(2);
      Status s = (*c->save(2, specs_, {}))->wait(30s);
      EXPECT_EQ(s.sys_errno(), err) << s.to_string();
      EXPECT_NE(s.to_string().find(victim), std::string::npos) << s.to_string();
    }
    EXPECT_EQ(*c->steps(), std::vector<int64_t>{1});
    EXPECT_FALSE(fs::exists(tmp_dir_path(root_.string(), 2)));
    fill_many(1);
    std::vector<std::vector<float>> got;
    ASSERT_TRUE(load_all(*c, 1, got).ok());
    EXPECT_EQ(got, data_);
    fill_many(3);  // the pool still serves the next save
    ASSERT_TRUE((*c->save(3, specs_, {}))->wait(30s).ok());
    ASSERT_TRUE(load_all(*c, 3, got).ok());
    EXPECT_EQ(got, data_);
  }
}

TEST_F(MultiFileTest, ARanksFilesMergeInTheDistributedCommit) {
  std::vector<std::vector<std::vector<float>>> saved;
  std::vector<std::vector<TensorSpec>> all_specs;
  for (int rank = 0; rank < 2; ++rank) {
    auto c = make_files(rank == 0 ? 3 : 2, rank, 2);
    fill_many(10 * rank, rank);
    auto h = c->save(4, specs_, {{"save_id", "s1"}}, /*commit=*/false);
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE((*h)->wait(30s).ok());
    saved.push_back(data_);
    all_specs.push_back(specs_);
  }
  ASSERT_TRUE(commit_shards(root_.string(), 4, 2, "s1").ok());
  auto reader = make_files(1);
  auto m = reader->manifest(4);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->shards.size(), 5u);
  for (int rank = 0; rank < 2; ++rank) {
    specs_ = all_specs[rank];
    std::vector<std::vector<float>> got;
    ASSERT_TRUE(load_all(*reader, 4, got).ok()) << rank;
    EXPECT_EQ(got, saved[rank]) << rank;
  }
}

// stage() + save_staged(): a staging cut down to a random subset of its tensors (renamed, in
// any order) plus added host tensors is written byte for byte as save() writes those tensors.
TEST_F(EngineTest, RestagedSubsetWritesTheFileSaveWouldWrite) {
  std::mt19937 gen(5);
  const char* dtypes[] = {"uint8", "float16", "float32", "int64"};
  const size_t esizes[] = {1, 2, 4, 8};
  auto random_bytes = [&](uint64_t n) {
    std::vector<std::byte> b(n);
    for (auto& x : b) x = static_cast<std::byte>(gen());
    return b;
  };
  auto random_spec = [&](const std::string& name, std::vector<std::byte>& bytes) {
    const size_t d = gen() % 4;
    const uint64_t pick[] = {0, 1, 4095, 64 << 10, (64 << 10) + 3, 300 << 10, 600 << 10};
    uint64_t n = pick[gen() % 7] + gen() % 9000;
    n -= n % esizes[d];
    bytes = random_bytes(n);
    return TensorSpec{name, dtypes[d], {static_cast<int64_t>(n / esizes[d])}, bytes.data(), n};
  };
  for (int round = 0; round < 16; ++round) {
    fs::remove_all(root_);
    auto c = make();
    const int n = 1 + static_cast<int>(gen() % 10);
    std::vector<std::vector<std::byte>> bytes(n), saved(n);
    std::vector<TensorSpec> staged;
    for (int i = 0; i < n; ++i) staged.push_back(random_spec("s" + std::to_string(i), bytes[i]));
    auto st = c->stage(staged);
    ASSERT_TRUE(st.ok()) << st.status().to_string();
    for (int i = 0; i < n; ++i) {  // the staging holds copies: the sources may change now
      saved[i] = bytes[i];
      for (auto& x : bytes[i]) x = std::byte{0x5A};
    }
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), gen);
    order.resize(gen() % (n + 1));
    std::vector<Restaged> keep;
    for (size_t i : order) keep.push_back(Restaged{i, "k" + std::to_string(i), {}, {}});
    const int m = static_cast<int>(gen() % 4);
    std::vector<std::vector<std::byte>> extra_bytes(m);
    std::vector<TensorSpec> extra;
    for (int j = 0; j < m; ++j)
      extra.push_back(random_spec("x" + std::to_string(j), extra_bytes[j]));
    ASSERT_TRUE(restage(*st, keep, extra, c->pool(), 64 << 10, 30s).ok()) << round;
    auto h = c->save_staged(1, std::move(st).value(), {});
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    ASSERT_TRUE((*h)->wait(30s).ok()) << round;
    // The same tensors through save(): kept ones in staging order, then the extras.
    std::sort(order.begin(), order.end());
    std::vector<TensorSpec> direct;
    for (size_t i : order) {
      TensorSpec t = staged[i];
      t.name = "k" + std::to_string(i);
      t.data = saved[i].data();
      direct.push_back(t);
    }
    direct.insert(direct.end(), extra.begin(), extra.end());
    h = c->save(2, direct, {});
    ASSERT_TRUE(h.ok() && (*h)->wait(30s).ok()) << round;
    auto read_file = [&](int64_t step) {
      std::ifstream f(step_dir_path(root_.string(), step) + "/" + shard_file_name(0),
                      std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(f), {});
    };
    const std::string restaged = read_file(1), direct_file = read_file(2);
    EXPECT_EQ(restaged.size(), direct_file.size()) << "round " << round;
    EXPECT_TRUE(restaged == direct_file) << "round " << round << ": the data files differ";
    auto m1 = c->manifest(1);
    ASSERT_TRUE(m1.ok());
    std::vector<std::vector<std::byte>> got;
    std::vector<ReadTarget> targets;
    for (const auto& t : direct) got.emplace_back(t.nbytes, std::byte{0xAB});
    for (size_t i = 0; i < direct.size(); ++i)
      targets.push_back({direct[i].name, got[i].data(), direct[i].nbytes});
    ASSERT_EQ(m1->tensors.size(), direct.size());
    ASSERT_TRUE(c->read(*m1, targets).ok()) << round;
    for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(got[i], saved[order[i]]) << round;
    for (int j = 0; j < m; ++j) EXPECT_EQ(got[order.size() + j], extra_bytes[j]) << round;
  }
}

TEST_F(EngineTest, AStagingIsSavedByACheckpointerSharingItsPoolOnly) {
  auto c = make();
  fill(3);
  auto other = CheckpointOptions::from_env((root_ / "other").string()).value();
  other.chunk_bytes = 64 << 10;
  other.timeout = 30s;
  auto shared = Checkpointer::create(other, c->shared_pool());
  ASSERT_TRUE(shared.ok());
  other.pool.slab_bytes = 256 << 10;
  other.pool.budget_bytes = 64 << 20;
  auto own = Checkpointer::create(other);
  ASSERT_TRUE(own.ok());
  auto st = c->stage(specs());
  ASSERT_TRUE(st.ok());
  // A bad restage leaves the staging as it was.
  std::vector<Restaged> twice = {{0, "a", {}, {}}, {0, "b", {}, {}}}, missing = {{2, "c", {}, {}}};
  EXPECT_EQ(restage(*st, twice, {}, c->pool(), 64 << 10, 30s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(restage(*st, missing, {}, c->pool(), 64 << 10, 30s).code(),
            StatusCode::kInvalidArgument);
  auto refused = (*own)->save_staged(1, std::move(st).value(), {});
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  st = c->stage(specs());
  ASSERT_TRUE(st.ok());
  fill(4);
  auto h = (*shared)->save_staged(1, std::move(st).value(), {{"step", 1}});
  ASSERT_TRUE(h.ok() && (*h)->wait(30s).ok());
  std::vector<float> big;
  std::vector<int64_t> small;
  ASSERT_TRUE(load_into(**shared, 1, big, small).ok());
  fill(3);
  EXPECT_EQ(big, big_);
  EXPECT_EQ(small, small_);
  shared->reset();
  EXPECT_EQ(c->pool().in_use_bytes(), 0u);
}

TEST(CheckpointOptionsTest, RestoreThreadsAreTheProcessShareOfTheHostByDefault) {
  EXPECT_EQ(auto_restore_threads(16, 1), 16);
  EXPECT_EQ(auto_restore_threads(128, 1), 16);  // at most 16
  EXPECT_EQ(auto_restore_threads(128, 8), 16);
  EXPECT_EQ(auto_restore_threads(64, 8), 8);
  EXPECT_EQ(auto_restore_threads(2, 1), 4);  // at least 4
  EXPECT_EQ(auto_restore_threads(16, 0), 16);
  CheckpointOptions o;
  o.root = "/ckpt";
  EXPECT_EQ(o.restore_threads, 0);
  EXPECT_TRUE(o.validate().ok());
  o.restore_threads = -1;
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
  o.restore_threads = 257;
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
  o.restore_threads = 0;
  o.files_per_rank = 0;
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
  o.files_per_rank = 65;
  EXPECT_EQ(o.validate().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace resilient::checkpoint
