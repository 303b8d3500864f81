#include "resilient/memory/pool.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "resilient/common/logging.hpp"
#include "resilient/memory/cuda.hpp"
#include "resilient/memory/populate.hpp"

namespace resilient::memory {
namespace {

constexpr uint64_t kAlign = 4096;

uint64_t round_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

uint64_t half_physical_memory() {
  long pages = ::sysconf(_SC_PHYS_PAGES);
  long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 4ull << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2;
}

const CudaRuntime* runtime_for(Feature pin) {
  return pin == Feature::kOff ? nullptr : CudaRuntime::get();
}

}  // namespace

Result<PoolOptions> PoolOptions::from_env() {
  PoolOptions o;
  RESILIENT_ASSIGN_OR_RETURN(o.slab_bytes,
                             env_value("RESILIENT_POOL_SLAB_BYTES", o.slab_bytes, parse_bytes));
  RESILIENT_ASSIGN_OR_RETURN(o.budget_bytes,
                             env_value("RESILIENT_POOL_BYTES", o.budget_bytes, parse_bytes));
  RESILIENT_ASSIGN_OR_RETURN(o.pin, env_value("RESILIENT_PIN_MEMORY", o.pin, parse_feature));
  RESILIENT_RETURN_IF_ERROR(o.validate());
  return o;
}

Status PoolOptions::validate() const {
  if (slab_bytes == 0 || slab_bytes > (1ull << 40)) {
    return Status(StatusCode::kInvalidArgument,
                  "slab_bytes (RESILIENT_POOL_SLAB_BYTES) must be in (0, 1 TiB], got " +
                      std::to_string(slab_bytes));
  }
  return ok_status();
}

// --- Slab ---------------------------------------------------------------------------------

Slab::~Slab() { release(); }

Slab::Slab(Slab&& other) noexcept
    : pool_(other.pool_), data_(other.data_), size_(other.size_), pinned_(other.pinned_) {
  other.pool_ = nullptr;
  other.data_ = nullptr;
}

Slab& Slab::operator=(Slab&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = other.pool_;
    data_ = other.data_;
    size_ = other.size_;
    pinned_ = other.pinned_;
    other.pool_ = nullptr;
    other.data_ = nullptr;
  }
  return *this;
}

void Slab::release() {
  if (pool_ != nullptr && data_ != nullptr) pool_->give_back(data_);
  pool_ = nullptr;
  data_ = nullptr;
}

// --- HostPool -----------------------------------------------------------------------------

HostPool::HostPool(PoolOptions options) : HostPool(options, runtime_for(options.pin)) {}

HostPool::HostPool(PoolOptions options, const CudaRuntime* cuda)
    : slab_bytes_(round_up(std::max<uint64_t>(options.slab_bytes, 1))),
      budget_bytes_(options.budget_bytes ? options.budget_bytes : half_physical_memory()),
      pinned_(options.pin != Feature::kOff && cuda != nullptr),
      pin_(options.pin),
      cuda_(pinned_ ? cuda : nullptr) {}

HostPool::~HostPool() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() != all_.size()) {
    RESILIENT_LOG(kError, "HostPool destroyed with " << (all_.size() - free_.size())
                                                     << " slab(s) still on loan; leaking them");
    for (std::byte* p : free_) free_slab(p);
    return;
  }
  for (std::byte* p : all_) free_slab(p);
}

Result<std::byte*> HostPool::allocate_slab(bool populate) {
  if (pin_ == Feature::kOn && cuda_ == nullptr) {
    return Status(StatusCode::kUnavailable,
                  std::string("RESILIENT_PIN_MEMORY=on but CUDA is unusable: ") +
                      CudaRuntime::unavailable_reason());
  }
  // Aligned memory pinned with cudaHostRegister rather than cudaHostAlloc: cudaHostAlloc may
  // sub-allocate and return addresses that are not 4 KiB aligned, which O_DIRECT rejects.
  void* p = nullptr;
  int rc = ::posix_memalign(&p, kAlign, slab_bytes_);
  if (rc != 0) {
    return Status(StatusCode::kResourceExhausted,
                  "cannot allocate a host slab of " + std::to_string(slab_bytes_) + " bytes")
        .with_errno(rc);
  }
  ::madvise(p, slab_bytes_, MADV_HUGEPAGE);  // fewer TLB misses in the snapshot memcpy
  auto* bytes = static_cast<std::byte*>(p);
  // A slab acquired for a copy gets its pages from that copy's first writes, on the threads
  // that copy (a save's copy threads fault their slabs in parallel; faulting them here would
  // serialise the first save's page faults on the caller's thread). reserve() warms them ahead.
  if (populate && cuda_ == nullptr && memory::populate_write(p, slab_bytes_) != 0) {
    for (uint64_t off = 0; off < slab_bytes_; off += kAlign) bytes[off] = std::byte{0};
  }
  if (cuda_ != nullptr) {  // pinning faults every page in
    Status st = cuda_->host_register(p, slab_bytes_);
    if (!st.ok()) {
      std::free(p);
      return st;
    }
  }
  return bytes;
}

void HostPool::free_slab(std::byte* data) {
  if (cuda_ != nullptr) {
    Status st = cuda_->host_unregister(data);
    if (!st.ok()) RESILIENT_LOG(kWarn, "unpinning a host slab: " << st.to_string());
  }
  std::free(data);
}

Result<Slab> HostPool::acquire(Duration timeout) {
  if (budget_bytes_ < slab_bytes_) {
    return Status(StatusCode::kResourceExhausted,
                  "host pool budget (" + std::to_string(budget_bytes_) +
                      " bytes) is smaller than one slab (" + std::to_string(slab_bytes_) + ")");
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!free_.empty()) {
      std::byte* p = free_.back();
      free_.pop_back();
      return Slab(this, p, slab_bytes_, pinned_);
    }
    if ((all_.size() + pending_ + 1) * slab_bytes_ <= budget_bytes_) {
      ++pending_;
      lock.unlock();
      Result<std::byte*> p = allocate_slab(false);  // may be slow (pinning): outside the lock
      lock.lock();
      --pending_;
      if (!p.ok()) {
        cv_.notify_all();
        return p.status();
      }
      all_.push_back(*p);
      ++epoch_;
      return Slab(this, *p, slab_bytes_, pinned_);
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && free_.empty() &&
        (all_.size() + pending_ + 1) * slab_bytes_ > budget_bytes_) {
      return Status(StatusCode::kTimeout, "no host slab released within " +
                                              std::to_string(to_seconds(timeout)) + " s (budget " +
                                              std::to_string(budget_bytes_) + " bytes in use)");
    }
  }
}

Status HostPool::reserve(uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = std::min(bytes, budget_bytes_);
  while ((all_.size() + pending_) * slab_bytes_ < target &&
         (all_.size() + pending_ + 1) * slab_bytes_ <= budget_bytes_) {
    ++pending_;
    lock.unlock();
    Result<std::byte*> p = allocate_slab(true);
    lock.lock();
    --pending_;
    if (!p.ok()) return p.status();
    all_.push_back(*p);
    free_.push_back(*p);
    ++epoch_;
    cv_.notify_one();
  }
  return ok_status();
}

void HostPool::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  for (std::byte* p : free_) {
    free_slab(p);
    all_.erase(std::find(all_.begin(), all_.end(), p));
  }
  if (!free_.empty()) ++epoch_;
  free_.clear();
  cv_.notify_all();  // room under the budget for waiters to allocate
}

void HostPool::give_back(std::byte* data) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(data);
  }
  cv_.notify_one();
}

uint64_t HostPool::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_.size() * slab_bytes_;
}

uint64_t HostPool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return (all_.size() - free_.size()) * slab_bytes_;
}

std::vector<std::pair<std::byte*, uint64_t>> HostPool::slabs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::byte*, uint64_t>> out;
  out.reserve(all_.size());
  for (std::byte* p : all_) out.emplace_back(p, slab_bytes_);
  return out;
}

uint64_t HostPool::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

}  // namespace resilient::memory
