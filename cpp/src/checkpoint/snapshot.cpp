#include "resilient/checkpoint/snapshot.hpp"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "resilient/common/logging.hpp"
#include "resilient/io/file.hpp"

namespace resilient::checkpoint {

Result<Layout> plan_layout(std::span<const TensorSpec> tensors, uint64_t slab_bytes,
                           uint64_t chunk_bytes) {
  RESILIENT_CHECK(slab_bytes > 0 && slab_bytes % io::kDirectAlignment == 0,
                  "slab size must be 4 KiB aligned");
  RESILIENT_CHECK(chunk_bytes > 0, "chunk size must be positive");
  Layout layout;
  layout.tensors.reserve(tensors.size());
  std::unordered_set<std::string> names;
  uint64_t pos = 0;
  for (const auto& t : tensors) {
    if (t.name.empty()) return Status(StatusCode::kInvalidArgument, "a tensor has an empty name");
    if (!names.insert(t.name).second)
      return Status(StatusCode::kInvalidArgument, "duplicate tensor name '" + t.name + "'");
    uint64_t esize = dtype_size(t.dtype);
    if (esize == 0)
      return Status(StatusCode::kInvalidArgument,
                    "tensor '" + t.name + "': unsupported dtype '" + t.dtype + "'");
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0)
        return Status(StatusCode::kInvalidArgument, "tensor '" + t.name + "': negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * esize != t.nbytes) {
      return Status(StatusCode::kInvalidArgument, "tensor '" + t.name + "': nbytes " +
                                                      std::to_string(t.nbytes) +
                                                      " does not match shape and dtype");
    }
    if (t.nbytes > 0 && t.data == nullptr)
      return Status(StatusCode::kInvalidArgument, "tensor '" + t.name + "': null data");
    TensorEntry e;
    e.name = t.name;
    e.dtype = t.dtype;
    e.shape = t.shape;
    e.nbytes = t.nbytes;
    e.global_shape = t.global_shape;
    e.global_offset = t.global_offset;
    // Small tensors are packed at their element alignment; the others start on a 4 KiB
    // boundary, so each is one aligned run of the file (docs/FORMAT.md, "Data files").
    pos = t.nbytes < kPackBelowBytes ? (pos + esize - 1) / esize * esize : io::align_up(pos);
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

DeviceStreams::~DeviceStreams() {
  memory::DeviceGuard keep_device(cuda_);  // destroyed on the caller's thread
  for (auto& [key, stream] : streams_) {
    (void)cuda_->set_device(key / per_device_);
    (void)cuda_->stream_synchronize(stream);
    (void)cuda_->stream_destroy(stream);
  }
  if (size_t left = reap(); left > 0) {
    RESILIENT_LOG(kWarn, left << " host slab(s) still wait for device-to-host copies that never "
                                 "completed; leaking them rather than reusing them");
    for (auto& h : quarantine_) h.slab.leak();
  }
}

void DeviceStreams::quarantine(std::shared_ptr<DeviceCopies> copies, size_t index,
                               memory::Slab slab) {
  std::lock_guard<std::mutex> lock(quarantine_mu_);
  quarantine_.push_back(Held{std::move(copies), index, std::move(slab)});
}

size_t DeviceStreams::reap() {
  std::vector<Held> done;  // returned (and their events destroyed) after the lock is dropped
  std::lock_guard<std::mutex> lock(quarantine_mu_);
  std::vector<Held> held;
  for (auto& h : quarantine_) (h.copies->slab_done(h.index) ? done : held).push_back(std::move(h));
  quarantine_ = std::move(held);
  if (!done.empty()) {
    RESILIENT_LOG(kInfo, "late device-to-host copies completed; "
                             << done.size() << " quarantined host slab(s) returned");
  }
  return quarantine_.size();
}

Result<memory::StreamHandle> DeviceStreams::get(int device, int index) {
  if (cuda_ == nullptr) {
    return Status(StatusCode::kUnavailable, std::string("CUDA tensors need the CUDA runtime: ") +
                                                memory::CudaRuntime::unavailable_reason());
  }
  RESILIENT_RETURN_IF_ERROR(cuda_->set_device(device));
  const int key = device * per_device_ + index % per_device_;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [k, s] : streams_) {
    if (k == key) return s;
  }
  memory::StreamHandle s = 0;
  RESILIENT_RETURN_IF_ERROR(cuda_->stream_create(&s));
  streams_.emplace_back(key, s);
  return s;
}

DeviceCopies::~DeviceCopies() {
  for (auto e : events) {
    (void)cuda->event_wait(e, std::chrono::seconds(60));
    (void)cuda->event_destroy(e);
  }
}

Status DeviceCopies::wait_slab(size_t i, Duration timeout) const {
  if (i >= slab_events.size()) return ok_status();
  for (auto e : slab_events[i]) {
    Status s = cuda->event_wait(e, timeout);
    if (!s.ok()) return s.prepend("device-to-host copy");
  }
  return ok_status();
}

bool DeviceCopies::slab_done(size_t i) const {
  if (i >= slab_events.size()) return true;
  for (auto e : slab_events[i]) {
    auto done = cuda->event_query(e);
    if (!done.ok() || !*done) return false;
  }
  return true;
}

Status DeviceCopies::wait_all(Duration timeout) const {
  const TimePoint deadline = SteadyClock::instance().now() + timeout;
  for (size_t i = 0; i < slab_events.size(); ++i) {
    RESILIENT_RETURN_IF_ERROR(
        wait_slab(i, std::max(deadline - SteadyClock::instance().now(), Duration::zero())));
  }
  return ok_status();
}

Status DeviceCopies::fence(memory::StreamHandle stream) const {
  for (auto e : events) RESILIENT_RETURN_IF_ERROR(cuda->stream_wait_event(stream, e));
  return ok_status();
}

void Staging::release_slabs() {
  // Never hand a slab back to the pool while a copy may still write into it.
  size_t held = 0;
  for (size_t i = 0; i < slabs.size(); ++i) {
    if (!slabs[i] || copies == nullptr || copies->slab_done(i)) {
      slabs[i].release();
    } else if (streams != nullptr) {
      streams->quarantine(copies, i, std::move(slabs[i]));
      ++held;
    } else {
      slabs[i].leak();
      ++held;
    }
  }
  slabs.clear();
  if (held > 0) {
    RESILIENT_LOG(kWarn, "device-to-host copies into "
                             << held
                             << " host slab(s) are not known to "
                                "have completed; the slabs stay out of the pool until they have");
  }
}

namespace {

struct Copy {
  std::byte* dst;
  const std::byte* src;
  uint64_t n;
  int device;  // -1: host
  size_t slab;
  size_t tensor;
};

// Issues the device copies in logical order, each copy stream ordered after the tensors'
// producing streams, and records one event per (group of slabs, device) after that group's
// copies (`group_bytes` of consecutive slabs share the event and a copy stream).
Status issue_device_copies(std::span<const TensorSpec> tensors, const std::vector<Copy>& work,
                           Staging& st, DeviceStreams& streams, uint64_t group_bytes) {
  const memory::CudaRuntime* cuda = streams.cuda();
  memory::DeviceGuard keep_device(cuda);  // runs on the caller's (PyTorch's) thread
  st.copies = std::make_shared<DeviceCopies>();
  st.copies->cuda = cuda;
  st.streams = &streams;
  auto& slab_events = st.copies->slab_events;
  slab_events.resize(st.slabs.size());
  // Order each copy stream after every producing stream of its device.
  std::vector<std::pair<int, memory::StreamHandle>> ordered;
  for (const auto& t : tensors) {
    if (t.device < 0 || t.nbytes == 0) continue;
    std::pair<int, memory::StreamHandle> key{t.device, t.stream};
    if (std::find(ordered.begin(), ordered.end(), key) != ordered.end()) continue;
    ordered.push_back(key);
    memory::EventHandle produced = 0;
    RESILIENT_RETURN_IF_ERROR(cuda->set_device(t.device));
    RESILIENT_RETURN_IF_ERROR(cuda->event_create(&produced));
    Status s = cuda->event_record(produced, t.stream);
    for (int k = 0; s.ok() && k < streams.per_device(); ++k) {
      auto copy_stream = streams.get(t.device, k);
      s = copy_stream.ok() ? cuda->stream_wait_event(*copy_stream, produced) : copy_stream.status();
    }
    (void)cuda->event_destroy(produced);  // destruction is deferred by CUDA until it completes
    RESILIENT_RETURN_IF_ERROR(s);
  }
  // Copies grouped by (group of slabs, device), in order, queued as one batch; an event closes
  // each group and is the event of each of its slabs.
  const size_t per_group = std::max<uint64_t>(1, group_bytes / st.slab_bytes);
  std::vector<memory::DeviceCopy> batch;
  size_t i = 0;
  while (i < work.size()) {
    if (work[i].device < 0) {
      ++i;
      continue;
    }
    const size_t group = work[i].slab / per_group;
    const int device = work[i].device;
    RESILIENT_ASSIGN_OR_RETURN(memory::StreamHandle stream,
                               streams.get(device, static_cast<int>(group)));
    batch.clear();
    const size_t first_slab = work[i].slab;
    size_t j = i;
    while (j < work.size() && work[j].slab / per_group == group && work[j].device == device) {
      // Consecutive chunks of one tensor in one slab become one copy. Never merge across
      // tensors (two allocations adjacent in address space still may not be copied as one)
      // nor across slabs (separate host buffers).
      const std::byte* src = work[j].src;
      std::byte* dst = work[j].dst;
      uint64_t n = work[j].n;
      const size_t tensor = work[j].tensor;
      const size_t slab = work[j].slab;
      for (++j; j < work.size() && work[j].slab == slab && work[j].tensor == tensor &&
                work[j].src == src + n && work[j].dst == dst + n;
           ++j) {
        n += work[j].n;
      }
      batch.push_back({dst, src, n});
    }
    Status s = cuda->memcpy_batch_async(batch, memory::CopyKind::kDeviceToHost, stream);
    memory::EventHandle done = 0;
    if (s.ok()) s = cuda->event_create(&done);
    if (s.ok()) {
      st.copies->events.push_back(done);
      s = cuda->event_record(done, stream);
    }
    if (!s.ok()) {
      // Some of this group's copies may be queued with no event closing them: wait for the
      // stream, so that none of its slabs goes back to the pool while a copy may still write.
      (void)cuda->stream_synchronize(stream);
      return s;
    }
    for (size_t slab = first_slab; slab <= work[j - 1].slab; ++slab)
      slab_events[slab].push_back(done);
    i = j;
  }
  return ok_status();
}

// Zeroes the gaps between chunks and the image's tail (alignment padding), so files are
// deterministic and no stale bytes leak to disk. A gap never crosses a 4 KiB boundary: every
// tensor starts at or before the next one.
void zero_gaps(Staging& st) {
  uint64_t end = 0;
  auto zero_to = [&](uint64_t next) {
    if (next <= end) return;
    std::memset(st.slabs[end / st.slab_bytes].data() + end % st.slab_bytes, 0, next - end);
  };
  for (const auto& t : st.layout.tensors) {
    for (const auto& c : t.chunks) {
      zero_to(c.offset);
      end = c.offset + c.raw;
    }
  }
  zero_to(st.layout.bytes);
}

}  // namespace

Result<Staging> snapshot(std::span<const TensorSpec> tensors, memory::HostPool& pool,
                         ThreadPool& copies, uint64_t chunk_bytes, Duration timeout,
                         DeviceStreams* streams, uint64_t copy_group_bytes) {
  if (streams != nullptr) streams->reap();
  Staging st;
  st.slab_bytes = pool.slab_bytes();
  RESILIENT_ASSIGN_OR_RETURN(st.layout, plan_layout(tensors, st.slab_bytes, chunk_bytes));
  bool any_device = false;
  for (const auto& t : tensors) any_device |= t.device >= 0 && t.nbytes > 0;
  if (any_device && (streams == nullptr || streams->cuda() == nullptr)) {
    return Status(StatusCode::kUnavailable, std::string("CUDA tensors need the CUDA runtime: ") +
                                                memory::CudaRuntime::unavailable_reason());
  }
  const uint64_t nslabs = (st.layout.bytes + st.slab_bytes - 1) / st.slab_bytes;
  if (nslabs * st.slab_bytes > pool.budget_bytes()) {
    return Status(StatusCode::kResourceExhausted,
                  "checkpoint shard of " + std::to_string(st.layout.bytes) +
                      " bytes exceeds the host pool budget of " +
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
  // One copy per chunk; chunks never cross slabs.
  std::vector<Copy> work;
  for (size_t ti = 0; ti < tensors.size(); ++ti) {
    const auto* src = static_cast<const std::byte*>(tensors[ti].data);
    uint64_t done = 0;
    for (const auto& c : st.layout.tensors[ti].chunks) {
      size_t slab = c.offset / st.slab_bytes;
      work.push_back(Copy{st.slabs[slab].data() + c.offset % st.slab_bytes, src + done, c.raw,
                          tensors[ti].device, slab, ti});
      done += c.raw;
    }
  }
  zero_gaps(st);
  if (any_device)
    RESILIENT_RETURN_IF_ERROR(issue_device_copies(tensors, work, st, *streams, copy_group_bytes));
  std::vector<size_t> host;
  for (size_t i = 0; i < work.size(); ++i) {
    if (work[i].device < 0) host.push_back(i);
  }
  copies.parallel_for(host.size(), [&](size_t k) {
    const Copy& c = work[host[k]];
    std::memcpy(c.dst, c.src, c.n);
  });
  return st;
}

Status restage(Staging& st, std::span<const Restaged> keep, std::span<const TensorSpec> extra,
               memory::HostPool& pool, uint64_t chunk_bytes, Duration timeout) {
  const TimePoint deadline = SteadyClock::instance().now() + timeout;
  if (st.copies) {  // all complete: the slabs no longer need their events (nor quarantine)
    RESILIENT_RETURN_IF_ERROR(st.copies->wait_all(timeout));
    st.copies.reset();
    st.streams = nullptr;
  }
  std::vector<const Restaged*> kept;
  for (const auto& k : keep) kept.push_back(&k);
  std::sort(kept.begin(), kept.end(), [](auto* a, auto* b) { return a->index < b->index; });
  std::vector<TensorSpec> specs;
  specs.reserve(kept.size() + extra.size());
  static const std::byte placeholder{};  // plan_layout wants data; kept bytes are in the slabs
  for (size_t i = 0; i < kept.size(); ++i) {
    if (kept[i]->index >= st.layout.tensors.size() ||
        (i > 0 && kept[i]->index == kept[i - 1]->index)) {
      return Status(
          StatusCode::kInvalidArgument,
          "staged tensor " + std::to_string(kept[i]->index) +
              (kept[i]->index >= st.layout.tensors.size() ? " does not exist" : " is kept twice"));
    }
    const TensorEntry& e = st.layout.tensors[kept[i]->index];
    specs.push_back(TensorSpec{kept[i]->name, e.dtype, e.shape, &placeholder, e.nbytes, -1, 0,
                               kept[i]->global_shape, kept[i]->global_offset});
  }
  for (const auto& x : extra) {
    if (x.device >= 0)
      return Status(StatusCode::kInvalidArgument,
                    "tensor '" + x.name + "': only host tensors are added to a staging");
    specs.push_back(x);
  }
  RESILIENT_ASSIGN_OR_RETURN(Layout layout, plan_layout(specs, st.slab_bytes, chunk_bytes));
  const uint64_t nslabs = (layout.bytes + st.slab_bytes - 1) / st.slab_bytes;
  std::vector<memory::Slab> more;
  for (uint64_t i = st.slabs.size(); i < nslabs; ++i) {
    Duration left = deadline - SteadyClock::instance().now();
    auto slab = pool.acquire(left > Duration::zero() ? left : Duration::zero());
    if (!slab.ok()) return Status(slab.status()).prepend("waiting for host buffers");
    more.push_back(std::move(slab).value());
  }
  // Nothing fails from here on.
  const uint64_t sb = st.slab_bytes;
  for (auto& s : more) st.slabs.push_back(std::move(s));
  auto at = [&](uint64_t off) { return st.slabs[off / sb].data() + off % sb; };
  for (size_t i = 0; i < kept.size(); ++i) {  // front to back: each destination <= its source
    const TensorEntry& old = st.layout.tensors[kept[i]->index];
    if (old.nbytes == 0) continue;
    uint64_t src = old.chunks.front().offset, dst = layout.tensors[i].chunks.front().offset;
    for (uint64_t n = old.nbytes; n > 0 && src != dst;) {
      const uint64_t m = std::min({n, sb - src % sb, sb - dst % sb});
      std::memmove(at(dst), at(src), m);
      src += m, dst += m, n -= m;
    }
  }
  for (size_t j = 0; j < extra.size(); ++j) {
    const auto* src = static_cast<const std::byte*>(extra[j].data);
    for (const auto& c : layout.tensors[kept.size() + j].chunks) {
      std::memcpy(at(c.offset), src, c.raw);
      src += c.raw;
    }
  }
  while (st.slabs.size() > nslabs) st.slabs.pop_back();  // back to the pool
  st.layout = std::move(layout);
  zero_gaps(st);
  return ok_status();
}

}  // namespace resilient::checkpoint
