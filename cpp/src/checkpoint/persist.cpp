#include "resilient/checkpoint/persist.hpp"

#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <system_error>
#include <thread>

#include "resilient/io/file.hpp"

namespace resilient::checkpoint {
namespace {

struct AlignedFree {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, AlignedFree>;

AlignedBuffer aligned_alloc_bytes(uint64_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, io::kDirectAlignment, std::max<uint64_t>(n, io::kDirectAlignment)) != 0)
    return nullptr;
  return AlignedBuffer(static_cast<std::byte*>(p));
}

// Every chunk (tensor index, chunk index) stored in slab `s`, in logical order.
std::vector<std::vector<std::pair<size_t, size_t>>> chunks_by_slab(const Staging& st) {
  std::vector<std::vector<std::pair<size_t, size_t>>> by(st.slabs.size());
  for (size_t t = 0; t < st.layout.tensors.size(); ++t) {
    const auto& chunks = st.layout.tensors[t].chunks;
    for (size_t c = 0; c < chunks.size(); ++c)
      by[chunks[c].offset / st.slab_bytes].emplace_back(t, c);
  }
  return by;
}

// Checksums are computed on the workers, slab by slab, running ahead of the writes. The writer
// submits every slab whose checksums are ready in one batch (up to kMaxBatchSlabs), so the io
// engine keeps its queue full across slab boundaries; slabs go back to the pool per batch.
constexpr size_t kMaxBatchSlabs = 8;

// What is left of the device copies' shared deadline: one timeout for the whole snapshot, not
// one per slab (a hung copy stream would otherwise hold the writer for slabs x timeout).
Duration left_until(TimePoint deadline) {
  return std::max(deadline - SteadyClock::instance().now(), Duration::zero());
}

Result<uint64_t> write_uncompressed(Staging& st, io::File& file, const PersistOptions& o,
                                    io::IoEngine& engine, ThreadPool& workers) {
  auto by_slab = chunks_by_slab(st);
  std::vector<std::future<void>> hashed(st.slabs.size());
  std::vector<Status> copy_errors(st.slabs.size());
  const TimePoint copied_by = SteadyClock::instance().now() + o.timeout;
  for (size_t s = 0; s < st.slabs.size(); ++s) {
    hashed[s] = workers.submit([&st, &by_slab, &copy_errors, copied_by, s] {
      copy_errors[s] = st.wait_slab(s, left_until(copied_by));  // device-to-host copies
      if (!copy_errors[s].ok()) return;
      for (auto [t, c] : by_slab[s]) {
        Chunk& ch = st.layout.tensors[t].chunks[c];
        ch.xxh3 = checksum(st.slabs[s].data() + ch.offset % st.slab_bytes, ch.len);
      }
    });
  }
  auto drain = [&] {
    for (auto& f : hashed)
      if (f.valid()) f.wait();
  };
  size_t s = 0;
  while (s < st.slabs.size()) {
    hashed[s].get();
    size_t end = s + 1;
    if (!copy_errors[s].ok()) {
      drain();
      return copy_errors[s];
    }
    while (end < st.slabs.size() && end - s < kMaxBatchSlabs &&
           hashed[end].wait_for(std::chrono::seconds(0)) == std::future_status::ready &&
           copy_errors[end].ok()) {
      hashed[end++].get();
    }
    std::vector<io::IoRequest> reqs;
    for (size_t k = s; k < end; ++k) {
      uint64_t begin = k * st.slab_bytes;
      reqs.push_back(io::IoRequest{st.slabs[k].data(),
                                   std::min(st.slab_bytes, st.layout.bytes - begin), begin});
    }
    Status w = engine.write(file, reqs, o.timeout);
    if (!w.ok()) {
      drain();
      return w;
    }
    for (size_t k = s; k < end; ++k) st.slabs[k].release();
    s = end;
  }
  return st.layout.bytes;
}

Result<uint64_t> write_compressed(Staging& st, io::File& file, const PersistOptions& o,
                                  io::IoEngine& engine, ThreadPool& workers) {
  auto by_slab = chunks_by_slab(st);
  uint64_t pos = 0;
  const TimePoint copied_by = SteadyClock::instance().now() + o.timeout;
  for (size_t s = 0; s < st.slabs.size(); ++s) {
    RESILIENT_RETURN_IF_ERROR(st.wait_slab(s, left_until(copied_by)));
    const auto& list = by_slab[s];
    std::vector<AlignedBuffer> out(list.size());
    std::vector<uint64_t> out_len(list.size());
    std::vector<Status> errs(list.size());
    workers.parallel_for(list.size(), [&](size_t i) {
      auto [t, c] = list[i];
      Chunk& ch = st.layout.tensors[t].chunks[c];
      const std::byte* src = st.slabs[s].data() + ch.offset % st.slab_bytes;
      size_t bound = ZSTD_compressBound(ch.raw);
      out[i] = aligned_alloc_bytes(io::align_up(bound));
      if (!out[i]) {
        errs[i] = Status(StatusCode::kResourceExhausted, "out of memory for a compression buffer");
        return;
      }
      size_t n = ZSTD_compress(out[i].get(), bound, src, ch.raw, o.zstd_level);
      if (ZSTD_isError(n) || n >= ch.raw) {  // incompressible: store raw
        std::memcpy(out[i].get(), src, ch.raw);
        n = ch.raw;
        ch.codec = Codec::kNone;
      } else {
        ch.codec = Codec::kZstd;
      }
      std::memset(out[i].get() + n, 0, io::align_up(n) - n);
      out_len[i] = n;
      ch.len = n;
      ch.xxh3 = checksum(out[i].get(), n);
    });
    for (const auto& e : errs) RESILIENT_RETURN_IF_ERROR(e);
    // Small stored chunks are packed into runs, one buffer each; a large one starts a new
    // 4 KiB-aligned request (as in the uncompressed image).
    std::vector<io::IoRequest> reqs;
    std::vector<AlignedBuffer> runs;
    size_t i = 0;
    while (i < list.size()) {
      Chunk* ch = &st.layout.tensors[list[i].first].chunks[list[i].second];
      if (out_len[i] >= kPackBelowBytes) {
        ch->offset = pos;
        reqs.push_back(io::IoRequest{out[i].get(), io::align_up(out_len[i]), pos});
        pos += io::align_up(out_len[i]);
        ++i;
        continue;
      }
      size_t j = i;
      uint64_t run = 0;
      for (; j < list.size() && out_len[j] < kPackBelowBytes; ++j) run += out_len[j];
      AlignedBuffer buf = aligned_alloc_bytes(io::align_up(run));
      if (!buf) {
        return Status(StatusCode::kResourceExhausted, "out of memory for a compression buffer");
      }
      std::memset(buf.get() + run, 0, io::align_up(run) - run);
      for (uint64_t at = 0; i < j; ++i) {
        ch = &st.layout.tensors[list[i].first].chunks[list[i].second];
        std::memcpy(buf.get() + at, out[i].get(), out_len[i]);
        ch->offset = pos + at;
        at += out_len[i];
        out[i].reset();
      }
      reqs.push_back(io::IoRequest{buf.get(), io::align_up(run), pos});
      runs.push_back(std::move(buf));
      pos += io::align_up(run);
    }
    RESILIENT_RETURN_IF_ERROR(engine.write(file, reqs, o.timeout));
    st.slabs[s].release();
  }
  return pos;
}

// One file of persist_files: the image's bytes [begin, end) from the slabs, in batches of
// hashed slabs as write_uncompressed does. A slab that several files share goes back to the pool
// when the last of them has written its part (`users`).
Status write_range(Staging& st, io::File& file, uint64_t begin, uint64_t end,
                   std::vector<std::shared_future<void>> hashed,  // a copy per thread
                   const std::vector<Status>& copy_errors, std::vector<std::atomic<int>>& users,
                   const std::atomic<bool>& stop, io::IoEngine& engine, Duration timeout) {
  const uint64_t slab = st.slab_bytes;
  size_t s = begin / slab;
  const size_t last = end == begin ? s : (end - 1) / slab;
  while (begin < end && s <= last) {
    if (stop.load(std::memory_order_relaxed)) {  // another file failed: the save has
      return Status(StatusCode::kCancelled, "save abandoned: another data file failed");
    }
    hashed[s].wait();
    if (!copy_errors[s].ok()) return copy_errors[s];
    size_t stop = s + 1;
    while (stop <= last && stop - s < kMaxBatchSlabs &&
           hashed[stop].wait_for(std::chrono::seconds(0)) == std::future_status::ready &&
           copy_errors[stop].ok()) {
      ++stop;
    }
    std::vector<io::IoRequest> reqs;
    for (size_t k = s; k < stop; ++k) {
      const uint64_t from = std::max(begin, k * slab);
      const uint64_t to = std::min(end, (k + 1) * slab);
      reqs.push_back(
          io::IoRequest{st.slabs[k].data() + (from - k * slab), to - from, from - begin});
    }
    RESILIENT_RETURN_IF_ERROR(engine.write(file, reqs, timeout));
    for (size_t k = s; k < stop; ++k) {
      if (users[k].fetch_sub(1, std::memory_order_acq_rel) == 1) st.slabs[k].release();
    }
    s = stop;
  }
  RESILIENT_RETURN_IF_ERROR(file.sync());
  return file.close();
}

}  // namespace

std::vector<uint64_t> plan_file_cuts(const Layout& layout, size_t files) {
  files = std::max<size_t>(files, 1);
  std::vector<uint64_t> starts;  // where a file may begin: the large tensors' aligned starts
  for (const auto& t : layout.tensors) {
    if (t.nbytes >= kPackBelowBytes && !t.chunks.empty() && t.chunks.front().offset > 0)
      starts.push_back(t.chunks.front().offset);
  }
  auto distance = [](uint64_t a, uint64_t b) { return a > b ? a - b : b - a; };
  std::vector<uint64_t> cuts{0};
  size_t next = 0;  // starts[next...] lie after the last cut (ascending)
  for (size_t i = 1; i < files && next < starts.size(); ++i) {
    const uint64_t target = layout.bytes / files * i;
    size_t best = next;  // the start nearest to an even share of the image
    while (best + 1 < starts.size() &&
           distance(starts[best + 1], target) <= distance(starts[best], target)) {
      ++best;
    }
    cuts.push_back(starts[best]);
    next = best + 1;
  }
  cuts.push_back(layout.bytes);
  return cuts;
}

Result<std::vector<PersistedFile>> persist_files(Staging& st, const io::Dir& dir,
                                                 const std::vector<std::string>& names,
                                                 const PersistOptions& o,
                                                 std::span<io::IoEngine* const> engines,
                                                 ThreadPool& workers) {
  if (o.zstd_level > 0 || names.empty() || engines.empty()) {
    return Status(StatusCode::kInvalidArgument,
                  "persist_files: uncompressed images, at least one name and one engine");
  }
  const std::vector<uint64_t> cuts =
      plan_file_cuts(st.layout, std::min(names.size(), engines.size()));
  const size_t n = cuts.size() - 1;
  std::vector<io::File> files;
  for (size_t i = 0; i < n; ++i) {
    RESILIENT_ASSIGN_OR_RETURN(io::File f, io::File::create_at(dir, names[i], o.direct));
    files.push_back(std::move(f));
  }
  auto by_slab = chunks_by_slab(st);
  std::vector<std::atomic<int>> users(st.slabs.size());
  for (size_t i = 0; i < n; ++i) {
    if (cuts[i] == cuts[i + 1]) continue;
    for (size_t k = cuts[i] / st.slab_bytes; k <= (cuts[i + 1] - 1) / st.slab_bytes; ++k)
      users[k].fetch_add(1, std::memory_order_relaxed);
  }
  std::vector<std::shared_future<void>> hashed(st.slabs.size());
  std::vector<Status> copy_errors(st.slabs.size());
  const TimePoint copied_by = SteadyClock::instance().now() + o.timeout;
  for (size_t s = 0; s < st.slabs.size(); ++s) {
    hashed[s] = workers
                    .submit([&st, &by_slab, &copy_errors, copied_by, s] {
                      copy_errors[s] = st.wait_slab(s, left_until(copied_by));
                      if (!copy_errors[s].ok()) return;
                      for (auto [t, c] : by_slab[s]) {
                        Chunk& ch = st.layout.tensors[t].chunks[c];
                        ch.xxh3 = checksum(st.slabs[s].data() + ch.offset % st.slab_bytes, ch.len);
                      }
                    })
                    .share();
  }
  std::vector<Status> results(n);
  std::atomic<bool> stop{false};  // one file failed: the others give up at their next batch
  auto write = [&](size_t i) {
    results[i] = write_range(st, files[i], cuts[i], cuts[i + 1], hashed, copy_errors, users, stop,
                             *engines[i], o.timeout);
    if (!results[i].ok()) stop.store(true, std::memory_order_relaxed);
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i < n; ++i) {  // file 0 on this thread; new threads inherit its priority
    try {
      threads.emplace_back(write, i);
    } catch (const std::system_error& e) {  // EAGAIN: a thread or process limit
      results[i] = Status(StatusCode::kResourceExhausted,
                          std::string("could not start a data file's writer thread: ") + e.what());
      stop.store(true);
      break;
    }
  }
  write(0);
  for (auto& t : threads) t.join();
  for (auto& f : hashed) f.wait();  // the workers still read the slabs and the layout
  for (const auto& r : results) {   // the failure itself, not the files it cancelled
    if (!r.ok() && r.code() != StatusCode::kCancelled) return r;
  }
  for (const auto& r : results) RESILIENT_RETURN_IF_ERROR(r);
  std::vector<PersistedFile> out;
  for (size_t i = 0; i < n; ++i) out.push_back(PersistedFile{names[i], cuts[i + 1] - cuts[i]});
  for (auto& t : st.layout.tensors) {  // offsets in the image -> offsets in the tensor's file
    if (t.chunks.empty()) continue;
    const auto file = static_cast<uint32_t>(
        std::upper_bound(cuts.begin(), cuts.end() - 1, t.chunks.front().offset) - cuts.begin() - 1);
    t.shard = file;
    for (auto& c : t.chunks) c.offset -= cuts[file];
  }
  return out;
}

uint64_t checksum(const void* data, uint64_t n) { return XXH3_64bits(data, n); }

Result<uint64_t> persist_shard(Staging& staging, const io::Dir& dir, const std::string& name,
                               const PersistOptions& options, io::IoEngine& engine,
                               ThreadPool& workers) {
  RESILIENT_ASSIGN_OR_RETURN(io::File file, io::File::create_at(dir, name, options.direct));
  Result<uint64_t> size = options.zstd_level > 0
                              ? write_compressed(staging, file, options, engine, workers)
                              : write_uncompressed(staging, file, options, engine, workers);
  if (!size.ok()) return size.status();
  RESILIENT_RETURN_IF_ERROR(file.sync());
  RESILIENT_RETURN_IF_ERROR(file.close());
  return size;
}

}  // namespace resilient::checkpoint
