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
  plan.extents = coalesce(chunks, plan.order, limits.slab_bytes);

  const uint64_t budget_slabs = std::max<uint64_t>(1, limits.budget_bytes / limits.slab_bytes);
  plan.slab_sets = budget_slabs >= 2 ? 2 : 1;
  const uint64_t threads_max =
      std::clamp<uint64_t>(budget_slabs / 2, 1, static_cast<uint64_t>(std::max(limits.threads, 1)));
  // Never so many per read that threads go without work (checksums and zstd run per thread).
  const uint64_t spread = (plan.extents.size() + threads_max - 1) / threads_max;
  plan.slabs_per_read = std::clamp<uint64_t>(
      limits.queue_depth * limits.request_bytes / limits.slab_bytes, 1,
      std::max<uint64_t>(1, std::min(spread, budget_slabs / (plan.slab_sets * threads_max))));

  for (size_t i = 0; i < plan.extents.size(); ++i) {
    if (!plan.groups.empty() &&
        plan.groups.back().second - plan.groups.back().first < plan.slabs_per_read &&
        plan.extents[plan.groups.back().first].shard == plan.extents[i].shard) {
      plan.groups.back().second = i + 1;
    } else {
      plan.groups.emplace_back(i, i + 1);
    }
  }
  plan.threads = std::clamp<size_t>(plan.groups.size(), 1, threads_max);
  return plan;
}

}  // namespace resilient::checkpoint::detail
