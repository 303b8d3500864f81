#include "resilient/checkpoint/restore.hpp"

#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "checkpoint/detail/read_plan.hpp"
#include "resilient/checkpoint/persist.hpp"
#include "resilient/common/logging.hpp"
#include "resilient/common/thread_pool.hpp"
#include "resilient/io/file.hpp"
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
// the same groups, or a chunk could be read twice and another never.
int64_t fingerprint(const detail::ReadPlan& plan, const std::vector<Piece>& pieces) {
  std::vector<uint64_t> words;
  words.reserve(4 + 2 * plan.groups.size() + 4 * plan.extents.size() + 6 * pieces.size());
  words.push_back(plan.groups.size());
  for (auto [first, last] : plan.groups) words.insert(words.end(), {first, last});
  for (const auto& x : plan.extents) words.insert(words.end(), {x.shard, x.offset, x.len, x.last});
  for (const auto& p : pieces)
    words.insert(words.end(),
                 {p.shard, p.chunk.offset, p.chunk.len, p.chunk.raw, p.chunk.xxh3, p.target});
  words.insert(words.end(), plan.order.begin(), plan.order.end());
  return static_cast<int64_t>(checksum(words.data(), words.size() * sizeof(uint64_t)) | 1);
}

// Host-to-device copies of one reader thread: a copy stream per device, and per staging buffer
// the events that must complete before the buffer is reused.
class DeviceWriter {
 public:
  explicit DeviceWriter(const memory::CudaRuntime* cuda) : cuda_(cuda) {}
  ~DeviceWriter() {
    if (cuda_ == nullptr) return;
    // Copies issued but not yet closed (a restore that failed mid-group) get their events too:
    // their staging buffers go back to the pool after this.
    for (int buf : {0, 1}) (void)close(buf);
    for (auto& pending : pending_) (void)wait(pending);
    for (auto [device, stream] : streams_) {
      (void)cuda_->set_device(device);
      (void)cuda_->stream_destroy(stream);
    }
  }
  // Copies n bytes from a staging buffer (index `buf`) to device memory, asynchronously.
  Status copy(int device, void* dst, const void* src, uint64_t n, int buf) {
    if (cuda_ == nullptr)
      return Status(StatusCode::kUnavailable, "device target but no CUDA runtime");
    RESILIENT_ASSIGN_OR_RETURN(memory::StreamHandle stream, stream_for(device));
    RESILIENT_RETURN_IF_ERROR(
        cuda_->memcpy_async(dst, src, n, memory::CopyKind::kHostToDevice, stream));
    used_[buf].emplace_back(device, stream);
    return ok_status();
  }
  // Closes buffer `buf`'s batch of copies with events.
  Status close(int buf) {
    for (auto [device, stream] : used_[buf]) {
      // An event belongs to the device current at its creation and must be recorded on a
      // stream of that device.
      RESILIENT_RETURN_IF_ERROR(cuda_->set_device(device));
      memory::EventHandle e = 0;
      RESILIENT_RETURN_IF_ERROR(cuda_->event_create(&e));
      pending_[buf].push_back(e);
      RESILIENT_RETURN_IF_ERROR(cuda_->event_record(e, stream));
    }
    used_[buf].clear();
    return ok_status();
  }
  // Waits until buffer `buf` may be overwritten.
  Status reuse(int buf) { return wait(pending_[buf]); }
  Status drain() {
    RESILIENT_RETURN_IF_ERROR(wait(pending_[0]));
    return wait(pending_[1]);
  }

 private:
  Result<memory::StreamHandle> stream_for(int device) {
    RESILIENT_RETURN_IF_ERROR(cuda_->set_device(device));
    for (auto [d, s] : streams_) {
      if (d == device) return s;
    }
    memory::StreamHandle s = 0;
    RESILIENT_RETURN_IF_ERROR(cuda_->stream_create(&s));
    streams_.emplace_back(device, s);
    return s;
  }
  Status wait(std::vector<memory::EventHandle>& events) {
    Status first;
    for (auto e : events) {
      Status s = cuda_->event_wait(e, std::chrono::seconds(600));
      if (!s.ok() && first.ok()) first = s;
      (void)cuda_->event_destroy(e);
    }
    events.clear();
    return first;
  }
  const memory::CudaRuntime* cuda_;
  std::vector<std::pair<int, memory::StreamHandle>> streams_;
  std::vector<std::pair<int, memory::StreamHandle>> used_[2];
  std::vector<memory::EventHandle> pending_[2];
};

Status decode(const Piece& p, const std::byte* stored, const std::string& path,
              DeviceWriter& device, int buf, std::vector<std::byte>& scratch) {
  if (checksum(stored, p.chunk.len) != p.chunk.xxh3) {
    Status s(StatusCode::kCorrupt, "checksum mismatch in tensor '" + *p.tensor + "'");
    s.with_path(path).with_offset(p.chunk.offset);
    return s;
  }
  if (p.dst == nullptr) return ok_status();
  if (p.populate && p.device < 0) {
    if (int e = memory::populate_write(p.dst, p.chunk.raw); e != 0) {
      Status s(
          StatusCode::kResourceExhausted,
          "no memory for tensor '" + *p.tensor + "' in its shared mapping (" + std::strerror(e) +
              (e == EINVAL ? ": a mapping that cannot be written, or Linux before 5.14)" : ")"));
      return s.with_path(path);
    }
  }
  if (p.device >= 0 && p.chunk.codec == Codec::kNone)
    return device.copy(p.device, p.dst, stored, p.chunk.raw, buf);
  if (p.chunk.codec == Codec::kNone) {
    std::memcpy(p.dst, stored, p.chunk.raw);
    return ok_status();
  }
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
  // What to read, in which groups, by how many threads (detail/read_plan.hpp); the reader
  // threads below execute the plan.
  const detail::ReadPlan plan =
      detail::plan_reads(chunks, {.slab_bytes = pool.slab_bytes(),
                                  .budget_bytes = pool.budget_bytes(),
                                  .threads = o.threads,
                                  .queue_depth = static_cast<uint64_t>(o.io.queue_depth),
                                  .request_bytes = o.io.request_bytes});
  const TimePoint deadline = SteadyClock::instance().now() + o.timeout;

  // Groups are claimed from `next`, or from the queue that the processes reading the same
  // targets share (RestoreOptions::queue), whose first process's plan every other must match.
  std::atomic<int64_t> next{0};
  std::optional<std::atomic_ref<int64_t>> shared_next;
  if (o.queue != nullptr) {
    std::atomic_ref<int64_t> plan_word(o.queue[1]);
    int64_t expected = 0;
    const int64_t mine = fingerprint(plan, pieces);
    if (!plan_word.compare_exchange_strong(expected, mine, std::memory_order_acq_rel) &&
        expected != mine) {
      // Claiming the others' groups by this plan could read a chunk twice and another never:
      // this process leaves the reads to those whose plan matches (the first one's does).
      RESILIENT_LOG(kWarn,
                    "restore: this rank planned its share of the host's reads differently "
                    "from the host's first reader (other RESILIENT_* read settings, pool "
                    "sizes or CPUs?); the other ranks read its share");
      if (o.bytes_read != nullptr) *o.bytes_read = 0;
      return ok_status();
    }
    shared_next.emplace(o.queue[0]);
  }
  auto claim = [&]() -> uint64_t {
    return static_cast<uint64_t>(shared_next ? shared_next->fetch_add(1, std::memory_order_relaxed)
                                             : next.fetch_add(1, std::memory_order_relaxed));
  };
  std::atomic<uint64_t> read_bytes{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  Status first_error;
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(err_mu);
    if (first_error.ok()) first_error = std::move(s);
    failed = true;
    if (shared_next) shared_next->store(kClosed, std::memory_order_relaxed);  // the others stop
  };
  // Each reader thread alternates between two sets of slabs so that the host-to-device copies
  // out of one overlap the read into the other.
  auto worker = [&] {
    auto engine = io::IoEngine::create(o.io);
    if (!engine.ok()) return fail(engine.status());
    // The buffers outlive the writer, whose destructor waits for the copies out of them.
    std::vector<memory::Slab> slabs[2] = {std::vector<memory::Slab>(plan.slabs_per_read),
                                          std::vector<memory::Slab>(plan.slabs_per_read)};
    using Heap = std::unique_ptr<std::byte, decltype(&std::free)>;
    std::vector<Heap> big;  // chunks larger than this pool's slabs (written with another slab size)
    DeviceWriter device(o.cuda);
    std::vector<std::byte> scratch;
    std::vector<io::IoRequest> reqs;
    int cur = 0;
    for (uint64_t g; !failed && (g = claim()) < plan.groups.size();
         cur = (cur + 1) % plan.slab_sets) {
      const auto [first, last] = plan.groups[g];
      if (Status r = device.reuse(cur); !r.ok()) return fail(r);
      reqs.clear();
      big.clear();
      for (size_t k = first; k < last; ++k) {
        const uint64_t n = plan.extents[k].len;
        memory::Slab& slab = slabs[cur][k - first];
        if (n <= pool.slab_bytes()) {
          if (!slab) {
            Duration left = deadline - SteadyClock::instance().now();
            auto s = pool.acquire(std::max(left, Duration::zero()));
            if (!s.ok()) return fail(Status(s.status()).prepend("waiting for host buffers"));
            slab = std::move(s).value();
          }
          reqs.push_back(io::IoRequest{slab.data(), n, plan.extents[k].offset});
        } else {
          void* p = nullptr;
          if (posix_memalign(&p, io::kDirectAlignment, n) != 0) {
            return fail(
                Status(StatusCode::kResourceExhausted, "out of memory reading a large chunk"));
          }
          big.emplace_back(static_cast<std::byte*>(p), &std::free);
          reqs.push_back(io::IoRequest{p, n, plan.extents[k].offset});
        }
      }
      Duration left = deadline - SteadyClock::instance().now();
      if (left <= Duration::zero()) return fail(Status(StatusCode::kTimeout, "restore timed out"));
      const uint32_t shard = plan.extents[first].shard;
      Status r = (*engine)->read(files[shard], reqs, left);
      if (!r.ok()) return fail(r);
      for (size_t k = first; k < last; ++k) {
        const detail::Extent& x = plan.extents[k];
        auto* buf = static_cast<std::byte*>(reqs[k - first].buf);
        for (size_t i = x.first; i < x.last; ++i) {
          const Piece& p = pieces[plan.order[i]];
          Status d =
              decode(p, buf + (p.chunk.offset - x.offset), paths[shard], device, cur, scratch);
          if (!d.ok()) return fail(d);
          if (p.dst != nullptr) read_bytes.fetch_add(p.chunk.raw, std::memory_order_relaxed);
          if (completions != nullptr && p.device < 0 && completions->done[p.target] != nullptr)
            completions->finished(p.target);
        }
      }
      Status c = device.close(cur);
      if (c.ok() && !big.empty()) c = device.reuse(cur);  // the heap buffers die with this group
      if (!c.ok()) return fail(c);
    }
    if (Status d = device.drain(); !d.ok()) fail(d);
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
  if (o.bytes_read != nullptr) *o.bytes_read = read_bytes.load();
  return first_error;
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
