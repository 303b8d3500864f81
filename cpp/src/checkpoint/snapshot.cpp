#include "resilient/checkpoint/snapshot.hpp"

#include <cstring>
#include <unordered_set>

#include "resilient/io/file.hpp"

namespace resilient::checkpoint {

Result<Layout> plan_layout(std::span<const TensorSpec> tensors, uint64_t slab_bytes, uint64_t chunk_bytes) {
  RESILIENT_CHECK(slab_bytes > 0 && slab_bytes % io::kDirectAlignment == 0, "slab size must be 4 KiB aligned");
  RESILIENT_CHECK(chunk_bytes > 0, "chunk size must be positive");
  Layout layout;
  layout.tensors.reserve(tensors.size());
  std::unordered_set<std::string> names;
  uint64_t pos = 0;
  for (const auto& t : tensors) {
    if (t.name.empty()) return Status(StatusCode::kInvalidArgument, "a tensor has an empty name");
    if (!names.insert(t.name).second) return Status(StatusCode::kInvalidArgument, "duplicate tensor name '" + t.name + "'");
    uint64_t esize = dtype_size(t.dtype);
    if (esize == 0) return Status(StatusCode::kInvalidArgument, "tensor '" + t.name + "': unsupported dtype '" + t.dtype + "'");
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return Status(StatusCode::kInvalidArgument, "tensor '" + t.name + "': negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * esize != t.nbytes) {
      return Status(StatusCode::kInvalidArgument, "tensor '" + t.name + "': nbytes " + std::to_string(t.nbytes) +
                                                      " does not match shape and dtype");
    }
    if (t.nbytes > 0 && t.data == nullptr) return Status(StatusCode::kInvalidArgument, "tensor '" + t.name + "': null data");
    TensorEntry e;
    e.name = t.name;
    e.dtype = t.dtype;
    e.shape = t.shape;
    e.nbytes = t.nbytes;
    e.global_shape = t.global_shape;
    e.global_offset = t.global_offset;
    pos = io::align_up(pos);
    uint64_t done = 0;
    while (done < t.nbytes) {
      uint64_t slab_end = (pos / slab_bytes + 1) * slab_bytes;
      uint64_t n = std::min({chunk_bytes, t.nbytes - done, slab_end - pos});
      e.chunks.push_back(Chunk{pos, n, n, 0, Codec::kNone});
      pos += n;
      done += n;
    }
    layout.tensors.push_back(std::move(e));
  }
  layout.bytes = io::align_up(pos);
  return layout;
}

Result<Staging> snapshot(std::span<const TensorSpec> tensors, memory::HostPool& pool, ThreadPool& copies,
                         uint64_t chunk_bytes, Duration timeout) {
  Staging st;
  st.slab_bytes = pool.slab_bytes();
  RESILIENT_ASSIGN_OR_RETURN(st.layout, plan_layout(tensors, st.slab_bytes, chunk_bytes));
  for (const auto& t : tensors) {
    if (t.device >= 0) {
      return Status(StatusCode::kUnavailable, "tensor '" + t.name + "' is on CUDA device " + std::to_string(t.device) +
                                                  ", which this snapshot path does not copy");
    }
  }
  const uint64_t nslabs = (st.layout.bytes + st.slab_bytes - 1) / st.slab_bytes;
  if (nslabs * st.slab_bytes > pool.budget_bytes()) {
    return Status(StatusCode::kResourceExhausted,
                  "checkpoint shard of " + std::to_string(st.layout.bytes) + " bytes exceeds the host pool budget of " +
                      std::to_string(pool.budget_bytes()) + " bytes (raise RESILIENT_POOL_BYTES)");
  }
  const TimePoint deadline = SteadyClock::instance().now() + timeout;
  st.slabs.reserve(nslabs);
  for (uint64_t i = 0; i < nslabs; ++i) {
    Duration left = deadline - SteadyClock::instance().now();
    auto slab = pool.acquire(left > Duration::zero() ? left : Duration::zero());
    if (!slab.ok()) return Status(slab.status()).prepend("waiting for host buffers");
    st.slabs.push_back(std::move(slab).value());
  }
  // One copy task per chunk; chunks never cross slabs.
  struct Copy {
    std::byte* dst;
    const std::byte* src;
    uint64_t n;
  };
  std::vector<Copy> work;
  for (size_t ti = 0; ti < tensors.size(); ++ti) {
    const auto* src = static_cast<const std::byte*>(tensors[ti].data);
    uint64_t done = 0;
    for (const auto& c : st.layout.tensors[ti].chunks) {
      std::byte* dst = st.slabs[c.offset / st.slab_bytes].data() + c.offset % st.slab_bytes;
      work.push_back(Copy{dst, src + done, c.raw});
      done += c.raw;
    }
  }
  copies.parallel_for(work.size(), [&](size_t i) { std::memcpy(work[i].dst, work[i].src, work[i].n); });
  // Zero the alignment padding so files are deterministic (and no stale bytes leak to disk).
  for (size_t ti = 0; ti < st.layout.tensors.size(); ++ti) {
    const auto& chunks = st.layout.tensors[ti].chunks;
    if (chunks.empty()) continue;
    uint64_t end = chunks.back().offset + chunks.back().raw;
    uint64_t pad_end = std::min(io::align_up(end), (end / st.slab_bytes + 1) * st.slab_bytes);
    if (end % st.slab_bytes == 0) continue;
    std::memset(st.slabs[end / st.slab_bytes].data() + end % st.slab_bytes, 0, pad_end - end);
  }
  return st;
}

}  // namespace resilient::checkpoint
