// Restore's read planning (checkpoint/detail/read_plan.hpp): worked examples, then properties
// checked over random chunk layouts and limits: every chunk read by exactly one aligned extent
// that covers it, no extent past its file's aligned end, none longer than a request unless it
// holds one chunk, and the slabs held at once within the pool's budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "checkpoint/detail/read_plan.hpp"
#include "resilient/io/file.hpp"

namespace resilient::checkpoint::detail {
namespace {

constexpr uint64_t kA = io::kDirectAlignment;

ReadLimits limits(uint64_t slab, uint64_t budget, int threads = 4, uint64_t queue_depth = 8,
                  uint64_t request_bytes = 1 << 20) {
  return {slab, budget, threads, queue_depth, request_bytes};
}

TEST(ReadPlan, ChunksThatLieTogetherShareOneAlignedExtent) {
  // Three small chunks in one page-aligned run, one past a gap, one in another shard.
  std::vector<ChunkLocation> chunks = {
      {0, 100, 50}, {0, 10, 90}, {0, 5000, 3000}, {0, 40 * kA, 10}, {1, 0, 10}};
  ReadPlan p = plan_reads(chunks, limits(4 * kA, 64 * kA, 4, 8, 4 * kA));
  EXPECT_EQ(p.order, (std::vector<size_t>{1, 0, 2, 3, 4}));
  ASSERT_EQ(p.extents.size(), 3u);
  EXPECT_EQ(p.extents[0].offset, 0u);
  EXPECT_EQ(p.extents[0].len, 2 * kA);  // chunks 1, 0, 2: [0, 8000) aligned up
  EXPECT_EQ(p.extents[0].first, 0u);
  EXPECT_EQ(p.extents[0].last, 3u);
  EXPECT_EQ(p.extents[1].offset, 40 * kA);  // [8192, 40 * kA) is a gap: not read
  EXPECT_EQ(p.extents[2].shard, 1u);
}

TEST(ReadPlan, AnExtentStopsAtTheSlabSize) {
  std::vector<ChunkLocation> chunks = {{0, 0, kA}, {0, kA, kA}, {0, 2 * kA, kA}};
  ReadPlan p = plan_reads(chunks, limits(2 * kA, 64 * kA, 4, 8, 64 * kA));
  ASSERT_EQ(p.extents.size(), 2u);
  EXPECT_EQ(p.extents[0].len, 2 * kA);
  EXPECT_EQ(p.extents[1].offset, 2 * kA);
}

// Adjacent chunks coalesce up to one engine request: each extent is checked and placed as soon
// as it is in.
TEST(ReadPlan, AnExtentStopsAtTheRequestSize) {
  std::vector<ChunkLocation> chunks;
  for (uint64_t i = 0; i < 16; ++i) chunks.push_back({0, i * kA, kA});  // 16 pages, no gaps
  ReadPlan p = plan_reads(chunks, limits(16 * kA, 1024 * kA, 4, 8, 2 * kA));
  ASSERT_EQ(p.extents.size(), 8u);
  EXPECT_EQ(p.extents[0].len, 2 * kA);
}

TEST(ReadPlan, AChunkLargerThanASlabIsReadAlone) {
  std::vector<ChunkLocation> chunks = {{0, 0, 10}, {0, kA, 5 * kA}, {0, 6 * kA, 10}};
  ReadPlan p = plan_reads(chunks, limits(2 * kA, 64 * kA));
  ASSERT_EQ(p.extents.size(), 3u);
  EXPECT_EQ(p.extents[1].len, 5 * kA);
  EXPECT_EQ(p.extents[1].last - p.extents[1].first, 1u);
}

// The threads share the engine's queue depth, each with one buffer more than it keeps in flight
// (checked while the next is read), within the budget.
TEST(ReadPlan, ThreadsShareTheQueueDepthWithABufferToSpare) {
  std::vector<ChunkLocation> chunks;
  for (uint64_t i = 0; i < 64; ++i) chunks.push_back({0, i * 2 * kA, kA});
  ReadPlan p = plan_reads(chunks, limits(kA, 64 * kA, 4, 16, kA));
  EXPECT_EQ(p.extents.size(), 64u);  // gaps between chunks: one extent each
  EXPECT_EQ(p.threads, 4u);
  EXPECT_EQ(p.in_flight, 4u);  // 16 over 4
  EXPECT_EQ(p.buffers, 5u);
  ReadPlan few = plan_reads(chunks, limits(kA, 64 * kA, 4, 2, kA));
  EXPECT_EQ(few.in_flight, 1u);
  EXPECT_EQ(few.buffers, 2u);
  ReadPlan one = plan_reads(chunks, limits(kA, 64 * kA, 1, 8, kA));
  EXPECT_EQ(one.in_flight, 8u);
  EXPECT_EQ(one.buffers, 9u);
  ReadPlan budget = plan_reads(chunks, limits(kA, 12 * kA, 4, 16, kA));  // 3 slabs a thread
  EXPECT_EQ(budget.in_flight, 2u);
  EXPECT_EQ(budget.buffers, 3u);
  // A one-slab budget: one thread, one buffer read and placed in turn.
  ReadPlan tight = plan_reads(chunks, limits(kA, kA / 2, 4, 4, kA));
  EXPECT_EQ(tight.threads, 1u);
  EXPECT_EQ(tight.in_flight, 1u);
  EXPECT_EQ(tight.buffers, 1u);
  // No more threads than extents.
  EXPECT_EQ(plan_reads({chunks.data(), 3}, limits(kA, 64 * kA, 8, 8, kA)).threads, 3u);
}

TEST(ReadPlan, NoChunksIsOneIdleThread) {
  ReadPlan p = plan_reads({}, limits(kA, 64 * kA));
  EXPECT_TRUE(p.extents.empty());
  EXPECT_EQ(p.threads, 1u);
}

TEST(ReadPlan, FindsTheFirstChunkPastItsFilesEnd) {
  std::vector<uint64_t> sizes = {10'000, 5000};
  std::vector<ChunkLocation> ok = {{0, 0, 10'000}, {1, 4096, 904}};
  EXPECT_FALSE(find_chunk_past_end(ok, sizes).has_value());
  std::vector<ChunkLocation> bad = {{0, 0, 100}, {1, 4096, 905}, {0, 9000, 2000}};
  EXPECT_EQ(find_chunk_past_end(bad, sizes), 1u);
}

// Random layouts: chunks of a few shards, some adjacent, some overlapping pages, some larger than
// a slab, some requested twice (two targets of one tensor); random slab, budget, threads, queue.
TEST(ReadPlan, PropertiesHoldForRandomLayouts) {
  std::mt19937_64 rng(20261123);
  auto uniform = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  for (int round = 0; round < 2000; ++round) {
    const uint32_t shards = static_cast<uint32_t>(uniform(1, 4));
    std::vector<ChunkLocation> chunks;
    std::vector<uint64_t> sizes(shards, 0);
    for (uint32_t s = 0; s < shards; ++s) {
      uint64_t at = uniform(0, 3) * kA;
      const size_t n = uniform(0, 12);
      for (size_t i = 0; i < n; ++i) {
        const uint64_t len = uniform(0, 4) == 0 ? uniform(1, 6 * kA) : uniform(1, kA);
        chunks.push_back({s, at, len});
        if (uniform(0, 6) == 0) chunks.push_back({s, at, len});  // requested twice
        at += len;
        if (uniform(0, 2) == 0) at = io::align_up(at);     // the next chunk starts a page
        if (uniform(0, 3) == 0) at += uniform(1, 3 * kA);  // a gap
      }
      sizes[s] = at + uniform(0, 100);
    }
    std::shuffle(chunks.begin(), chunks.end(), rng);
    ASSERT_FALSE(find_chunk_past_end(chunks, sizes).has_value());
    const ReadLimits lim =
        limits(uniform(1, 8) * kA, uniform(0, 40) * kA, static_cast<int>(uniform(0, 8)),
               uniform(1, 16), uniform(1, 4) * kA);
    const ReadPlan p = plan_reads(chunks, lim);

    // order is a permutation sorted by (shard, offset).
    std::vector<size_t> sorted = p.order;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) ASSERT_EQ(sorted[i], i);
    for (size_t i = 1; i < p.order.size(); ++i) {
      const ChunkLocation& a = chunks[p.order[i - 1]];
      const ChunkLocation& b = chunks[p.order[i]];
      ASSERT_TRUE(a.shard < b.shard || (a.shard == b.shard && a.offset <= b.offset));
    }
    // Extents partition the order, each chunk inside its extent, aligned, within the file.
    size_t next_chunk = 0;
    for (const Extent& x : p.extents) {
      ASSERT_EQ(x.first, next_chunk);
      ASSERT_LT(x.first, x.last);
      next_chunk = x.last;
      ASSERT_EQ(x.offset % kA, 0u);
      ASSERT_EQ(x.len % kA, 0u);
      ASSERT_GT(x.len, 0u);
      ASSERT_LE(x.offset + x.len, io::align_up(sizes[x.shard]));
      if (x.len > lim.slab_bytes) ASSERT_EQ(x.last - x.first, 1u);
      for (size_t i = x.first; i < x.last; ++i) {
        const ChunkLocation& c = chunks[p.order[i]];
        ASSERT_EQ(c.shard, x.shard);
        ASSERT_GE(c.offset, x.offset);
        ASSERT_LE(c.offset + c.len, x.offset + x.len);
      }
    }
    ASSERT_EQ(next_chunk, chunks.size());
    // Threads and buffers: at least one thread, no more than wanted or than there are extents,
    // and the buffers all threads hold at once within the budget (a budget under one slab: one).
    const uint64_t budget_slabs = std::max<uint64_t>(1, lim.budget_bytes / lim.slab_bytes);
    ASSERT_GE(p.threads, 1u);
    ASSERT_LE(p.threads, static_cast<size_t>(std::max(lim.threads, 1)));
    ASSERT_LE(p.threads, std::max<size_t>(1, p.extents.size()));
    ASSERT_GE(p.buffers, 1u);
    ASSERT_GE(p.in_flight, 1u);
    ASSERT_TRUE(p.buffers == p.in_flight + 1 || (p.buffers == 1 && p.in_flight == 1));
    ASSERT_LE(p.threads * p.buffers, budget_slabs) << "round " << round;
    for (const Extent& x : p.extents) {
      if (x.len > std::min(lim.slab_bytes, lim.request_bytes)) ASSERT_EQ(x.last - x.first, 1u);
    }
  }
}

}  // namespace
}  // namespace resilient::checkpoint::detail
