#include "resilient/checkpoint/restore.hpp"

#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "resilient/checkpoint/persist.hpp"
#include "resilient/io/file.hpp"

namespace resilient::checkpoint {
namespace {

struct Piece {
  uint32_t shard;
  Chunk chunk;
  std::byte* dst;  // nullptr: verify only
  const std::string* tensor;
};

struct Extent {
  uint32_t shard;
  uint64_t begin;  // aligned file offset
  uint64_t end;    // aligned
  size_t first, last;  // pieces [first, last)
};

std::vector<Extent> coalesce(const std::vector<Piece>& pieces, uint64_t max_bytes) {
  std::vector<Extent> out;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& p = pieces[i];
    uint64_t b = p.chunk.offset / io::kDirectAlignment * io::kDirectAlignment;
    uint64_t e = io::align_up(p.chunk.offset + p.chunk.len);
    if (!out.empty()) {
      Extent& x = out.back();
      if (x.shard == p.shard && b >= x.begin && b <= x.end && std::max(e, x.end) - x.begin <= max_bytes) {
        x.end = std::max(e, x.end);
        x.last = i + 1;
        continue;
      }
    }
    out.push_back(Extent{p.shard, b, e, i, i + 1});
  }
  return out;
}

Status decode(const Piece& p, const std::byte* stored, const std::string& path) {
  if (checksum(stored, p.chunk.len) != p.chunk.xxh3) {
    Status s(StatusCode::kCorrupt, "checksum mismatch in tensor '" + *p.tensor + "'");
    s.with_path(path).with_offset(p.chunk.offset);
    return s;
  }
  if (p.dst == nullptr) return ok_status();
  if (p.chunk.codec == Codec::kNone) {
    std::memcpy(p.dst, stored, p.chunk.raw);
    return ok_status();
  }
  size_t n = ZSTD_decompress(p.dst, p.chunk.raw, stored, p.chunk.len);
  if (ZSTD_isError(n) || n != p.chunk.raw) {
    Status s(StatusCode::kCorrupt, "bad zstd data in tensor '" + *p.tensor + "'");
    s.with_path(path).with_offset(p.chunk.offset);
    return s;
  }
  return ok_status();
}

Status run_pieces(const std::string& step_dir, const Manifest& m, std::vector<Piece> pieces,
                  const RestoreOptions& o, memory::HostPool& pool) {
  // Open each needed shard once and check the manifest's extents against the real sizes.
  std::vector<io::File> files(m.shards.size());
  std::vector<std::string> paths(m.shards.size());
  for (const auto& p : pieces) {
    if (files[p.shard].is_open()) continue;
    paths[p.shard] = step_dir + "/" + m.shards[p.shard].file;
    auto f = io::File::open_read(paths[p.shard], o.io.direct);
    if (!f.ok()) return Status(f.status()).prepend("opening checkpoint shard");
    files[p.shard] = std::move(f).value();
  }
  std::vector<uint64_t> sizes(m.shards.size(), 0);
  for (size_t s = 0; s < files.size(); ++s) {
    if (!files[s].is_open()) continue;
    RESILIENT_ASSIGN_OR_RETURN(sizes[s], files[s].size());
  }
  for (const auto& p : pieces) {
    if (p.chunk.offset + p.chunk.len > sizes[p.shard] || io::align_up(p.chunk.offset + p.chunk.len) > io::align_up(sizes[p.shard])) {
      Status s(StatusCode::kCorrupt, "tensor '" + *p.tensor + "' extends past the end of its data file (truncated)");
      s.with_path(paths[p.shard]).with_offset(p.chunk.offset);
      return s;
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.shard != b.shard ? a.shard < b.shard : a.chunk.offset < b.chunk.offset;
  });
  const auto extents = coalesce(pieces, pool.slab_bytes());
  const TimePoint deadline = SteadyClock::instance().now() + o.timeout;

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  Status first_error;
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(err_mu);
    if (first_error.ok()) first_error = std::move(s);
    failed = true;
  };
  auto worker = [&] {
    auto engine = io::IoEngine::create(o.io);
    if (!engine.ok()) return fail(engine.status());
    memory::Slab slab;
    for (size_t i; !failed && (i = next.fetch_add(1)) < extents.size();) {
      const Extent& x = extents[i];
      const uint64_t n = x.end - x.begin;
      std::byte* buf;
      std::unique_ptr<std::byte, decltype(&std::free)> big(nullptr, &std::free);
      if (n <= pool.slab_bytes()) {
        if (!slab) {
          Duration left = deadline - SteadyClock::instance().now();
          auto s = pool.acquire(std::max(left, Duration::zero()));
          if (!s.ok()) return fail(Status(s.status()).prepend("waiting for host buffers"));
          slab = std::move(s).value();
        }
        buf = slab.data();
      } else {  // a chunk larger than this pool's slabs (written with another slab size)
        void* p = nullptr;
        if (posix_memalign(&p, io::kDirectAlignment, n) != 0) {
          return fail(Status(StatusCode::kResourceExhausted, "out of memory reading a large chunk"));
        }
        big.reset(static_cast<std::byte*>(p));
        buf = big.get();
      }
      Duration left = deadline - SteadyClock::instance().now();
      if (left <= Duration::zero()) return fail(Status(StatusCode::kTimeout, "restore timed out"));
      io::IoRequest req{buf, n, x.begin};
      Status r = (*engine)->read(files[x.shard], {&req, 1}, left);
      if (!r.ok()) return fail(r);
      for (size_t k = x.first; k < x.last; ++k) {
        Status d = decode(pieces[k], buf + (pieces[k].chunk.offset - x.begin), paths[x.shard]);
        if (!d.ok()) return fail(d);
      }
    }
  };
  size_t nthreads = std::clamp<size_t>(o.threads, 1, std::max<size_t>(extents.size(), 1));
  std::vector<std::thread> threads;
  for (size_t t = 1; t < nthreads; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  return first_error;
}

}  // namespace

Status restore_tensors(const std::string& step_dir, const Manifest& m, std::span<const ReadTarget> targets,
                       const RestoreOptions& o, memory::HostPool& pool) {
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < m.tensors.size(); ++i) index.emplace(m.tensors[i].name, i);
  std::vector<Piece> pieces;
  for (const auto& t : targets) {
    auto it = index.find(t.name);
    if (it == index.end()) {
      return Status(StatusCode::kNotFound, "tensor '" + t.name + "' is not in checkpoint step " + std::to_string(m.step));
    }
    const TensorEntry& e = m.tensors[it->second];
    if (e.nbytes != t.nbytes) {
      return Status(StatusCode::kInvalidArgument, "tensor '" + t.name + "': checkpoint holds " + std::to_string(e.nbytes) +
                                                      " bytes, target has " + std::to_string(t.nbytes));
    }
    if (t.device >= 0) {
      return Status(StatusCode::kUnavailable, "tensor '" + t.name + "': restoring into device memory is not available here");
    }
    uint64_t raw_off = 0;
    for (const auto& c : e.chunks) {
      pieces.push_back(Piece{e.shard, c, static_cast<std::byte*>(t.dst) + raw_off, &e.name});
      raw_off += c.raw;
    }
  }
  return run_pieces(step_dir, m, std::move(pieces), o, pool);
}

Status verify_step(const std::string& step_dir, const Manifest& m, const RestoreOptions& o, memory::HostPool& pool) {
  std::vector<Piece> pieces;
  for (const auto& e : m.tensors) {
    for (const auto& c : e.chunks) pieces.push_back(Piece{e.shard, c, nullptr, &e.name});
  }
  return run_pieces(step_dir, m, std::move(pieces), o, pool);
}

}  // namespace resilient::checkpoint
