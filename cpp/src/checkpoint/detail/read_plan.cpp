#include "checkpoint/detail/read_plan.hpp"

#include <algorithm>
#include <numeric>

#include "resilient/io/file.hpp"

namespace resilient::checkpoint::detail {
namespace {

uint64_t align_down(uint64_t x) { return x / io::kDirectAlignment * io::kDirectAlignment; }

// Chunks (in `order`) that lie together in one shard share an extent while it fits `max_bytes`.
std::vector<Extent> coalesce(std::span<const ChunkLocation> chunks,
                             const std::vector<size_t>& order, uint64_t max_bytes) {
  std::vector<Extent> out;
  for (size_t i = 0; i < order.size(); ++i) {
    const ChunkLocation& c = chunks[order[i]];
    const uint64_t begin = align_down(c.offset);
    const uint64_t end = io::align_up(c.offset + c.len);
    if (!out.empty()) {
      Extent& x = out.back();
      const uint64_t x_end = x.offset + x.len;
      if (x.shard == c.shard && begin >= x.offset && begin <= x_end &&
          std::max(end, x_end) - x.offset <= max_bytes) {
        x.len = std::max(end, x_end) - x.offset;
        x.last = i + 1;
        continue;
      }
    }
    out.push_back(Extent{c.shard, begin, end - begin, i, i + 1});
  }
  return out;
}

}  // namespace

std::optional<size_t> find_chunk_past_end(std::span<const ChunkLocation> chunks,
                                          std::span<const uint64_t> file_sizes) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkLocation& c = chunks[i];
    const uint64_t size = file_sizes[c.shard];
    if (c.offset + c.len > size || io::align_up(c.offset + c.len) > io::align_up(size)) return i;
  }
  return std::nullopt;
}

ReadPlan plan_reads(std::span<const ChunkLocation> chunks, const ReadLimits& limits) {
  ReadPlan plan;
  plan.order.resize(chunks.size());
  std::iota(plan.order.begin(), plan.order.end(), size_t{0});
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](size_t a, size_t b) {
    const ChunkLocation& x = chunks[a];
    const ChunkLocation& y = chunks[b];
    return x.shard != y.shard ? x.shard < y.shard : x.offset < y.offset;
  });
  plan.extents = coalesce(chunks, plan.order, std::min(limits.slab_bytes, limits.request_bytes));
  const uint64_t budget_slabs = std::max<uint64_t>(1, limits.budget_bytes / limits.slab_bytes);
  plan.threads = std::clamp<size_t>(
      std::min<size_t>(static_cast<size_t>(std::max(limits.threads, 1)), plan.extents.size()), 1,
      budget_slabs);
  // Each thread keeps its share of the engine's queue depth in flight and has one buffer more,
  // whose extent it checks and places meanwhile; within the budget (no buffer to spare: one
  // buffer, read and placed in turn).
  const uint64_t per_thread = budget_slabs / plan.threads;
  plan.in_flight = std::max<uint64_t>(
      1, std::min((limits.queue_depth + plan.threads - 1) / plan.threads, per_thread - 1));
  plan.buffers = per_thread >= 2 ? plan.in_flight + 1 : 1;
  return plan;
}

}  // namespace resilient::checkpoint::detail
