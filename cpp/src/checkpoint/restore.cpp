#include "resilient/checkpoint/restore.hpp"

#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "checkpoint/detail/device_writer.hpp"
#include "checkpoint/detail/read_plan.hpp"
#include "resilient/checkpoint/persist.hpp"
#include "resilient/common/logging.hpp"
#include "resilient/common/thread_pool.hpp"
#include "resilient/io/file.hpp"
#include "resilient/io/page_cache.hpp"
#include "resilient/memory/populate.hpp"

namespace resilient::checkpoint {
namespace {

// A closed queue: no group index is this large, so every claim after it ends the claimer's reads.
constexpr int64_t kClosed = int64_t{1} << 62;

struct Piece {
  uint32_t shard;
  Chunk chunk;
  std::byte* dst;  // nullptr: verify only
  const std::string* tensor;
  int device = -1;
  size_t target = 0;      // index into the Completions, when there are any
  bool populate = false;  // ReadTarget::populate
};

// Targets whose `done` word is made odd once all their chunks are in place: each chunk adds 2
// to the word (in the word itself: the processes of a shared queue complete a target together),
// and the one that completes it adds 1.
struct Completions {
  std::vector<uint64_t> chunks;
  std::vector<int64_t*> done;

  void finished(size_t target) {
    std::atomic_ref<int64_t> word(*done[target]);
    const auto all = static_cast<int64_t>(2 * chunks[target]);
    if (word.fetch_add(2, std::memory_order_acq_rel) + 2 == all)
      word.fetch_add(1, std::memory_order_release);
  }
};

// The fingerprint of a plan and the pieces it reads: processes that share a queue must claim
// the same extents, or a chunk could be read twice and another never.
int64_t fingerprint(const detail::ReadPlan& plan, const std::vector<Piece>& pieces) {
  std::vector<uint64_t> words;
  words.reserve(4 + 4 * plan.extents.size() + 6 * pieces.size());
  words.push_back(plan.extents.size());
  for (const auto& x : plan.extents) words.insert(words.end(), {x.shard, x.offset, x.len, x.last});
  for (const auto& p : pieces)
    words.insert(words.end(),
                 {p.shard, p.chunk.offset, p.chunk.len, p.chunk.raw, p.chunk.xxh3, p.target});
  words.insert(words.end(), plan.order.begin(), plan.order.end());
  return static_cast<int64_t>(checksum(words.data(), words.size() * sizeof(uint64_t)) | 1);
}

using detail::DeviceWriter;

Status mismatch(const Piece& p, const std::string& path) {
  Status s(StatusCode::kCorrupt, "checksum mismatch in tensor '" + *p.tensor + "'");
  s.with_path(path).with_offset(p.chunk.offset);
  return s;
}

// The pages of a host target in a shared mapping, allocated before they are written.
Status populate(const Piece& p, const std::string& path) {
  if (!p.populate || p.device >= 0 || p.dst == nullptr) return ok_status();
  if (int e = memory::populate_write(p.dst, p.chunk.raw); e != 0) {
    Status s(StatusCode::kResourceExhausted,
             "no memory for tensor '" + *p.tensor + "' in its shared mapping (" + std::strerror(e) +
                 (e == EINVAL ? ": a mapping that cannot be written, or Linux before 5.14)" : ")"));
    return s.with_path(path);
  }
  return ok_status();
}

// checksum() of bytes that arrive block by block. The state lives on the heap: its layout is
// not part of the shared library's ABI. Without memory for it, ok() is false (hash in one go).
class StreamingChecksum {
 public:
  StreamingChecksum() : state_(XXH3_createState(), &XXH3_freeState) {
    if (state_) XXH3_64bits_reset(state_.get());
  }
  bool ok() const { return state_ != nullptr; }
  void update(const std::byte* p, uint64_t n) { XXH3_64bits_update(state_.get(), p, n); }
  uint64_t digest() const { return XXH3_64bits_digest(state_.get()); }

 private:
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state_;
};

// Blocks small enough to stay in the CPU's cache between the two passes over them (hash and
// copy), so the bytes come from memory once.
constexpr uint64_t kBlock = 256 << 10;

// checksum(src, n) while copying src to dst.
uint64_t checksum_copy(std::byte* dst, const std::byte* src, uint64_t n) {
  StreamingChecksum sum;
  if (n <= kBlock || !sum.ok()) {
    std::memcpy(dst, src, n);
    return checksum(src, n);
  }
  for (uint64_t off = 0; off < n; off += kBlock) {
    const uint64_t m = std::min(kBlock, n - off);
    sum.update(src + off, m);
    std::memcpy(dst + off, src + off, m);
  }
  return sum.digest();
}

// Verifies one stored chunk and puts it in place: host targets get the bytes (a checksum
// mismatch is found after they were written, which a failed load allows: see restore.hpp),
// device targets an asynchronous copy out of the staging buffer `buf`, compressed chunks are
// decompressed (into `scratch` first for a device target).
Status decode(const Piece& p, const std::byte* stored, const std::string& path,
              DeviceWriter& device, size_t buf, std::vector<std::byte>& scratch) {
  if (p.dst != nullptr && p.device < 0 && p.chunk.codec == Codec::kNone) {
    RESILIENT_RETURN_IF_ERROR(populate(p, path));
    if (checksum_copy(static_cast<std::byte*>(p.dst), stored, p.chunk.len) != p.chunk.xxh3)
      return mismatch(p, path);
    return ok_status();
  }
  if (checksum(stored, p.chunk.len) != p.chunk.xxh3) return mismatch(p, path);
  if (p.dst == nullptr) return ok_status();
  RESILIENT_RETURN_IF_ERROR(populate(p, path));
  if (p.device >= 0 && p.chunk.codec == Codec::kNone)
    return device.copy(p.device, p.dst, stored, p.chunk.raw, buf);
  std::byte* out = p.dst;
  if (p.device >= 0) {  // decompress on the host, then copy (synchronously: scratch is reused)
    RESILIENT_RETURN_IF_ERROR(device.reuse(buf));
    scratch.resize(p.chunk.raw);
    out = scratch.data();
  }
  size_t n = ZSTD_decompress(out, p.chunk.raw, stored, p.chunk.len);
  if (ZSTD_isError(n) || n != p.chunk.raw) {
    Status s(StatusCode::kCorrupt, "bad zstd data in tensor '" + *p.tensor + "'");
    s.with_path(path).with_offset(p.chunk.offset);
    return s;
  }
  if (p.device >= 0) {
    RESILIENT_RETURN_IF_ERROR(device.copy(p.device, p.dst, out, p.chunk.raw, buf));
    RESILIENT_RETURN_IF_ERROR(device.close(buf));
    return device.reuse(buf);
  }
  return ok_status();
}

// The units [first, last) of extent `x` that hold chunk `c`'s bytes.
std::pair<uint64_t, uint64_t> units_of(const Chunk& c, const detail::Extent& x, uint64_t unit) {
  const uint64_t begin = c.offset / io::kDirectAlignment * io::kDirectAlignment - x.offset;
  const uint64_t end = io::align_up(c.offset + c.len) - x.offset;
  return {begin / unit, (end + unit - 1) / unit};
}

// A shard's page-cache side: which of its pages are cached, and a buffered descriptor to read
// them with (io/page_cache.hpp). Only for shards opened O_DIRECT: a buffered shard's reads go
// through the cache anyway.
struct ShardCache {
  io::CachedPages pages;
  io::File file;
  bool usable = false;
};

// Takes chunk `p` from the page cache when every page of it is there: read into a host target
// (or `bounce`, for a compressed chunk) and checked. False (nothing placed, the device read
// follows) for device targets, verification-only reads (`resilient ckpt verify` checks the
// device's copy), pages not all cached, and pages evicted before the read got them.
Result<bool> from_page_cache(const Piece& p, const ShardCache& sc, const std::string& path,
                             DeviceWriter& device, size_t buf, std::vector<std::byte>& bounce) {
  if (!sc.usable || p.device >= 0 || p.dst == nullptr) return false;
  if (!sc.pages.resident(p.chunk.offset, p.chunk.len)) return false;
  const bool in_place = p.chunk.codec == Codec::kNone;
  if (in_place) {
    RESILIENT_RETURN_IF_ERROR(populate(p, path));
  } else {
    bounce.resize(p.chunk.len);
  }
  std::byte* to = in_place ? static_cast<std::byte*>(p.dst) : bounce.data();
  // Block by block, each hashed while the CPU's cache still holds it.
  StreamingChecksum sum;
  for (uint64_t off = 0; off < p.chunk.len; off += kBlock) {
    const uint64_t n = std::min(kBlock, p.chunk.len - off);
    auto got = io::read_cached(sc.file, to + off, n, p.chunk.offset + off);
    if (!got.ok()) {
      log_once("restore.page_cache_failed", LogLevel::kInfo,
               "restore: reading from the page cache failed (" + got.status().to_string() +
                   "); reading from the device instead");
      return false;
    }
    if (*got < n) return false;  // evicted meanwhile: from the device
    if (in_place && sum.ok()) sum.update(to + off, n);
  }
  if (!in_place) {
    std::vector<std::byte> unused;  // decode needs scratch only for device targets
    RESILIENT_RETURN_IF_ERROR(decode(p, bounce.data(), path, device, buf, unused));
    return true;
  }
  const uint64_t h = sum.ok() ? sum.digest() : checksum(to, p.chunk.len);
  if (h != p.chunk.xxh3) return mismatch(p, path);
  return true;
}

// What the reader threads of one restore share: the opened shards, the plan, where the next
// group is claimed, the first error and the counts.
struct Restore {
  const std::vector<Piece>& pieces;
  const detail::ReadPlan& plan;
  const std::vector<io::File>& files;
  const std::vector<std::string>& paths;
  const std::vector<ShardCache>& shard_cache;
  memory::HostPool& pool;
  const RestoreOptions& o;
  TimePoint deadline;
  Completions* completions;
  std::atomic<int64_t> next{0};
  std::optional<std::atomic_ref<int64_t>> shared_next;  // RestoreOptions::queue
  std::atomic<uint64_t> read_bytes{0}, cached_bytes{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  Status first_error;

  // The next group to read: from this process's counter, or from the host's shared queue.
  uint64_t claim() {
    return static_cast<uint64_t>(shared_next ? shared_next->fetch_add(1, std::memory_order_relaxed)
                                             : next.fetch_add(1, std::memory_order_relaxed));
  }
  void fail(Status s) {
    std::lock_guard<std::mutex> lock(err_mu);
    if (first_error.ok()) first_error = std::move(s);
    failed = true;
    if (shared_next) shared_next->store(kClosed, std::memory_order_relaxed);  // the others stop
  }
  // A chunk is in place: counted, and its target told when it was the target's last.
  void finished(const Piece& p) {
    if (p.dst != nullptr) read_bytes.fetch_add(p.chunk.raw, std::memory_order_relaxed);
    if (completions != nullptr && p.device < 0 && completions->done[p.target] != nullptr)
      completions->finished(p.target);
  }
};

// One reader thread: claims extents, takes what the page cache holds of each, and streams
// the rest through its engine (io::ReadStream) in request_bytes units into a ring of buffers,
// one extent each; a chunk is checked and put in place as soon as the units holding it are in,
// while the engine keeps reading the next units, and an extent's buffer is reused once all its
// chunks are placed (for device targets, once their copies out of it are done).
class StreamReader final : public io::ReadStream {
 public:
  StreamReader(Restore& r, size_t buffers)
      : r_(r), unit_(r.o.io.request_bytes), slots_(buffers), device_(r.o.cuda, buffers) {}

  Result<bool> next(io::StreamRequest& out) override {
    for (;;) {
      if (issuing_ != kNone) {  // the next unit of the extent being issued
        Slot& s = slots_[issuing_];
        while (unit_next_ < s.in.size() && s.in[unit_next_]) ++unit_next_;
        if (unit_next_ < s.in.size()) {
          const detail::Extent& x = r_.plan.extents[s.extent];
          const uint64_t at = unit_next_ * unit_;
          out = io::StreamRequest{&r_.files[x.shard], s.buf + at, std::min(unit_, x.len - at),
                                  x.offset + at, (uint64_t{issuing_} << 32) | unit_next_};
          ++unit_next_;
          return true;
        }
        issuing_ = kNone;
      }
      // An extent is claimed only when a buffer is free for it, so it is read at once: the
      // threads' reads reach the device in file order, the order an I/O scheduler such as
      // mq-deadline serves them in (a thread that claimed extents ahead got them all last, and
      // checked them alone at the end while the others idled).
      if (r_.failed || exhausted_) return false;
      const size_t free = first_free();
      if (free == kNone) return false;  // every buffer busy: more once a done() frees one
      const uint64_t k = r_.claim();
      if (k >= r_.plan.extents.size()) {
        exhausted_ = true;
        return false;
      }
      RESILIENT_RETURN_IF_ERROR(start(k, free));
    }
  }

  Status done(uint64_t tag) override {
    slots_[tag >> 32].in[tag & 0xffffffffu] = 1;
    return place(tag >> 32);
  }

  // After the stream: every extent placed, every device copy done.
  Status finish() {
    for (const Slot& s : slots_) {
      if (s.busy) {
        return Status(StatusCode::kInternal, "restore: a chunk was read but not placed")
            .with_path(r_.paths[r_.plan.extents[s.extent].shard]);
      }
    }
    return device_.drain();
  }

 private:
  static constexpr size_t kNone = ~size_t{0};
  using Heap = std::unique_ptr<std::byte, decltype(&std::free)>;
  // A buffer of the ring and the extent read into it: which units are in (or not needed: their
  // chunks came from the page cache), which chunks came from the cache, the next to place.
  struct Slot {
    memory::Slab slab;
    Heap heap{nullptr, &std::free};  // an extent larger than a slab (another slab size wrote it)
    std::byte* buf = nullptr;
    size_t extent = 0;
    std::vector<char> in, cached;
    size_t next = 0;
    bool busy = false;
  };

  size_t first_free() const {
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i].busy) return i;
    }
    return kNone;
  }

  // Extent k into slot `i`: its cached chunks placed now, the units of the others to be issued.
  Status start(size_t k, size_t i) {
    const detail::Extent& x = r_.plan.extents[k];
    Slot& s = slots_[i];
    s.cached.assign(x.last - x.first, 0);
    const ShardCache& sc = r_.shard_cache[x.shard];
    for (size_t c = x.first; c < x.last && sc.usable; ++c) {
      const Piece& p = r_.pieces[r_.plan.order[c]];
      RESILIENT_ASSIGN_OR_RETURN(bool got,
                                 from_page_cache(p, sc, r_.paths[x.shard], device_, i, bounce_));
      if (!got) continue;
      s.cached[c - x.first] = 1;
      r_.finished(p);
      r_.cached_bytes.fetch_add(p.chunk.raw, std::memory_order_relaxed);
    }
    s.in.assign((x.len + unit_ - 1) / unit_, 1);  // units no chunk needs count as in
    bool any = false;
    for (size_t c = x.first; c < x.last; ++c) {
      if (s.cached[c - x.first]) continue;
      const auto [u0, u1] = units_of(r_.pieces[r_.plan.order[c]].chunk, x, unit_);
      for (uint64_t u = u0; u < u1; ++u) s.in[u] = 0;
      any = true;
    }
    if (!any) return device_.close(i);            // all from the page cache
    RESILIENT_RETURN_IF_ERROR(device_.reuse(i));  // its last extent's copies to the device are done
    if (x.len <= r_.pool.slab_bytes()) {
      if (!s.slab) {
        const Duration left = r_.deadline - SteadyClock::instance().now();
        auto slab = r_.pool.acquire(std::max(left, Duration::zero()));
        if (!slab.ok()) return Status(slab.status()).prepend("waiting for host buffers");
        s.slab = std::move(slab).value();
      }
      s.buf = s.slab.data();
    } else {
      void* p = nullptr;
      if (posix_memalign(&p, io::kDirectAlignment, x.len) != 0)
        return Status(StatusCode::kResourceExhausted, "out of memory reading a large chunk");
      s.heap.reset(static_cast<std::byte*>(p));
      s.buf = s.heap.get();
    }
    s.extent = k;
    s.next = x.first;
    s.busy = true;
    issuing_ = i;
    unit_next_ = 0;
    return ok_status();
  }

  // Places slot i's chunks, in file order, whose units are all in; frees the slot after the last.
  Status place(size_t i) {
    Slot& s = slots_[i];
    const detail::Extent& x = r_.plan.extents[s.extent];
    for (; s.next < x.last; ++s.next) {
      if (s.cached[s.next - x.first]) continue;
      const Piece& p = r_.pieces[r_.plan.order[s.next]];
      const auto [u0, u1] = units_of(p.chunk, x, unit_);
      for (uint64_t u = u0; u < u1; ++u) {
        if (!s.in[u]) return ok_status();
      }
      RESILIENT_RETURN_IF_ERROR(
          decode(p, s.buf + (p.chunk.offset - x.offset), r_.paths[x.shard], device_, i, scratch_));
      r_.finished(p);
    }
    s.busy = false;
    RESILIENT_RETURN_IF_ERROR(device_.close(i));
    if (s.heap) {  // the heap buffer dies with its extent, once its copies are done
      RESILIENT_RETURN_IF_ERROR(device_.reuse(i));
      s.heap.reset();
    }
    return ok_status();
  }

  Restore& r_;
  const uint64_t unit_;
  std::vector<Slot> slots_;  // before device_: its destructor waits for copies out of them
  DeviceWriter device_;
  std::vector<std::byte> scratch_, bounce_;
  size_t issuing_ = kNone;  // the slot whose units next() hands out
  uint64_t unit_next_ = 0;
  bool exhausted_ = false;  // no extent left to claim
};

Status run_pieces(const std::string& step_dir, const Manifest& m, const std::vector<Piece>& pieces,
                  const RestoreOptions& o, memory::HostPool& pool,
                  Completions* completions = nullptr) {
  // Open each needed shard once and check the manifest's extents against the real sizes. The
  // step directory and the shards are opened without following links (a step directory
  // replaced by a link, to /etc say, is corrupt).
  std::vector<io::File> files(m.shards.size());
  std::vector<std::string> paths(m.shards.size());
  io::Dir dir;
  if (!pieces.empty()) {
    const size_t slash = step_dir.find_last_of('/');
    const std::string parent_path =
        slash == std::string::npos ? "." : step_dir.substr(0, std::max<size_t>(slash, 1));
    auto parent = io::Dir::open(parent_path);
    auto opened = parent.ok() ? parent->open_dir(step_dir.substr(slash + 1), /*for_write=*/false)
                              : parent.status();
    if (!opened.ok()) return Status(opened.status()).prepend("opening checkpoint step");
    dir = std::move(opened).value();
  }
  for (const auto& p : pieces) {
    if (files[p.shard].is_open()) continue;
    paths[p.shard] = step_dir + "/" + m.shards[p.shard].file;
    auto f = io::File::open_read_at(dir, m.shards[p.shard].file, o.io.direct);
    if (!f.ok()) return Status(f.status()).prepend("opening checkpoint shard");
    files[p.shard] = std::move(f).value();
  }
  std::vector<uint64_t> sizes(m.shards.size(), 0);
  for (size_t s = 0; s < files.size(); ++s) {
    if (!files[s].is_open()) continue;
    RESILIENT_ASSIGN_OR_RETURN(sizes[s], files[s].size());
  }
  std::vector<ShardCache> shard_cache(m.shards.size());
  for (size_t s = 0; s < files.size() && o.page_cache; ++s) {
    if (!files[s].is_open() || !files[s].direct()) continue;
    auto pages = io::CachedPages::map(files[s]);
    auto file = io::File::open_read_at(dir, m.shards[s].file, Feature::kOff);
    if (!pages.ok() || !file.ok()) continue;  // the device, as without the cache
    shard_cache[s] = ShardCache{std::move(pages).value(), std::move(file).value(), true};
  }
  std::vector<detail::ChunkLocation> chunks;
  chunks.reserve(pieces.size());
  for (const auto& p : pieces) chunks.push_back({p.shard, p.chunk.offset, p.chunk.len});
  if (auto bad = detail::find_chunk_past_end(chunks, sizes)) {
    const Piece& p = pieces[*bad];
    Status s(StatusCode::kCorrupt,
             "tensor '" + *p.tensor + "' extends past the end of its data file (truncated)");
    s.with_path(paths[p.shard]).with_offset(p.chunk.offset);
    return s;
  }
  // What to read, in which extents, by how many threads (detail/read_plan.hpp); the reader
  // threads below execute the plan.
  const detail::ReadPlan plan =
      detail::plan_reads(chunks, {.slab_bytes = pool.slab_bytes(),
                                  .budget_bytes = pool.budget_bytes(),
                                  .threads = o.threads,
                                  .queue_depth = static_cast<uint64_t>(o.io.queue_depth),
                                  .request_bytes = o.io.request_bytes});
  const TimePoint deadline = SteadyClock::instance().now() + o.timeout;

  Restore r{pieces, plan, files, paths, shard_cache, pool, o, deadline, completions};
  // Extents are claimed from r.next, or from the queue that the processes reading the same
  // targets share (RestoreOptions::queue), whose first process's plan every other must match.
  if (o.queue != nullptr) {
    std::atomic_ref<int64_t> plan_word(o.queue[1]);
    int64_t expected = 0;
    const int64_t mine = fingerprint(plan, pieces);
    if (!plan_word.compare_exchange_strong(expected, mine, std::memory_order_acq_rel) &&
        expected != mine) {
      // Claiming the others' extents by this plan could read a chunk twice and another never:
      // this process leaves the reads to those whose plan matches (the first one's does).
      RESILIENT_LOG(kWarn,
                    "restore: this rank planned its share of the host's reads differently "
                    "from the host's first reader (other RESILIENT_* read settings, pool "
                    "sizes or CPUs?); the other ranks read its share");
      if (o.bytes_read != nullptr) *o.bytes_read = 0;
      if (o.bytes_cached != nullptr) *o.bytes_cached = 0;
      return ok_status();
    }
    r.shared_next.emplace(o.queue[0]);
  }
  // Each thread's engine keeps its share of the queue depth in flight (one buffer spare, for the
  // extent being checked): the threads together about the engine's queue depth.
  io::IoOptions io = o.io;
  io.queue_depth = static_cast<int>(plan.in_flight);
  const size_t buffers = plan.buffers;
  auto worker = [&] {
    auto engine = io::IoEngine::create(io);
    if (!engine.ok()) return r.fail(engine.status());
    StreamReader reader(r, buffers);
    const Duration left = deadline - SteadyClock::instance().now();
    Status s = (*engine)->read_stream(reader, std::max(left, Duration::zero()));
    if (s.ok()) s = reader.finish();
    if (!s.ok()) r.fail(s);
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < plan.threads; ++t) {
    threads.emplace_back([&worker] {
      set_thread_name("rs-restore");
      worker();
    });
  }
  {
    memory::DeviceGuard keep_device(o.cuda);  // the caller's (PyTorch's) thread runs one too
    worker();
  }
  for (auto& t : threads) t.join();
  if (o.bytes_read != nullptr) *o.bytes_read = r.read_bytes.load();
  if (o.bytes_cached != nullptr) *o.bytes_cached = r.cached_bytes.load();
  return r.first_error;
}

}  // namespace

Status restore_tensors(const std::string& step_dir, const Manifest& m,
                       std::span<const ReadTarget> targets, const RestoreOptions& o,
                       memory::HostPool& pool) {
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < m.tensors.size(); ++i) index.emplace(m.tensors[i].name, i);
  std::vector<Piece> pieces;
  Completions completions;
  bool any_done = false;
  for (const auto& t : targets) {
    auto it = index.find(t.name);
    if (it == index.end()) {
      return Status(StatusCode::kNotFound,
                    "tensor '" + t.name + "' is not in checkpoint step " + std::to_string(m.step));
    }
    const TensorEntry& e = m.tensors[it->second];
    if (e.nbytes != t.nbytes) {
      return Status(StatusCode::kInvalidArgument,
                    "tensor '" + t.name + "': checkpoint holds " + std::to_string(e.nbytes) +
                        " bytes, target has " + std::to_string(t.nbytes));
    }
    if (t.device >= 0 && o.cuda == nullptr) {
      return Status(StatusCode::kUnavailable, "tensor '" + t.name +
                                                  "' is on a CUDA device but CUDA is not usable: " +
                                                  memory::CudaRuntime::unavailable_reason());
    }
    if (t.done != nullptr && reinterpret_cast<uintptr_t>(t.done) % alignof(int64_t) != 0) {
      return Status(StatusCode::kInvalidArgument,
                    "tensor '" + t.name + "': its done word is not 8-byte aligned");
    }
    const size_t target = completions.done.size();
    completions.done.push_back(t.device < 0 ? t.done : nullptr);
    completions.chunks.push_back(e.chunks.size());
    any_done = any_done || completions.done.back() != nullptr;
    uint64_t raw_off = 0;
    for (const auto& c : e.chunks) {
      pieces.push_back(Piece{e.shard, c, static_cast<std::byte*>(t.dst) + raw_off, &e.name,
                             t.device, target, t.populate});
      raw_off += c.raw;
    }
    if (e.chunks.empty() && completions.done.back() != nullptr)  // an empty tensor: in place
      std::atomic_ref<int64_t>(*t.done).store(1, std::memory_order_release);
  }
  return run_pieces(step_dir, m, pieces, o, pool, any_done ? &completions : nullptr);
}

Status verify_step(const std::string& step_dir, const Manifest& m, const RestoreOptions& o,
                   memory::HostPool& pool) {
  std::vector<Piece> pieces;
  for (const auto& e : m.tensors) {
    for (const auto& c : e.chunks) pieces.push_back(Piece{e.shard, c, nullptr, &e.name});
  }
  return run_pieces(step_dir, m, pieces, o, pool);
}

}  // namespace resilient::checkpoint
