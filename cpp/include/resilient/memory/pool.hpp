#pragma once
// A pool of fixed-size host slabs, 4 KiB aligned for O_DIRECT, reused across checkpoints. Slabs
// are pinned (cudaHostRegister) when CUDA is usable (pinning costs ~0.65 s per GiB, so the pool
// never frees them between saves), plain aligned memory otherwise, whose pages the first copy
// into them faults in (in parallel on the copy threads) unless reserve() warmed them. The total is
// bounded by a budget; acquire() waits for a release when the budget is reached.

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "resilient/common/clock.hpp"
#include "resilient/common/config.hpp"
#include "resilient/common/status.hpp"

namespace resilient::memory {

struct PoolOptions {
  uint64_t slab_bytes = 64ull << 20;  // RESILIENT_POOL_SLAB_BYTES (rounded up to 4 KiB)
  uint64_t budget_bytes = 0;          // RESILIENT_POOL_BYTES; 0 = half of physical memory
  Feature pin = Feature::kAuto;       // RESILIENT_PIN_MEMORY: pin with CUDA when available

  /// Defaults with the RESILIENT_POOL_* / RESILIENT_PIN_MEMORY overrides, then validate()d.
  static Result<PoolOptions> from_env();
  Status validate() const;
};

class HostPool;
class CudaRuntime;

/// A slab on loan from a pool; returns itself on destruction. Move-only. The pool must outlive
/// every Slab it handed out.
class Slab {
 public:
  Slab() = default;
  ~Slab();
  Slab(Slab&& other) noexcept;
  Slab& operator=(Slab&& other) noexcept;
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool pinned() const { return pinned_; }
  /// The pool the slab returns to (null once released or leaked).
  const HostPool* owner() const { return pool_; }
  explicit operator bool() const { return data_ != nullptr; }
  /// Returns the slab to the pool now.
  void release();
  /// Gives the slab up without returning it: the pool never reuses nor frees its memory (for a
  /// slab a device may still write into). The pool logs it as on loan when destroyed.
  void leak() {
    pool_ = nullptr;
    data_ = nullptr;
  }

 private:
  friend class HostPool;
  class CudaRuntime;
  Slab(HostPool* pool, std::byte* data, uint64_t size, bool pinned)
      : pool_(pool), data_(data), size_(size), pinned_(pinned) {}
  HostPool* pool_ = nullptr;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  bool pinned_ = false;
};

/// Thread-safe.
class HostPool {
 public:
  /// `options`: the defaults unless given (PoolOptions::from_env() reads the environment).
  explicit HostPool(PoolOptions options = PoolOptions{});
  /// As above with an explicit CUDA runtime for pinning (nullptr: never pin). For tests and for
  /// callers that already hold the runtime.
  HostPool(PoolOptions options, const CudaRuntime* cuda);
  ~HostPool();  // frees every slab; all Slabs must have been released
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  /// A free slab, allocating a new one while under budget, else waiting up to `timeout` for a
  /// release (kTimeout). kResourceExhausted if the budget is smaller than one slab; kIoError-like
  /// statuses if allocation itself fails. A newly allocated unpinned slab's pages are faulted in
  /// by its first writes (by the threads that fill it), not here.
  Result<Slab> acquire(Duration timeout);
  /// Pre-allocates slabs until `bytes` are held (bounded by the budget), their pages faulted in:
  /// a warm-up ahead of the first save.
  Status reserve(uint64_t bytes);
  /// Frees the slabs not on loan.
  void trim();

  uint64_t slab_bytes() const { return slab_bytes_; }
  uint64_t budget_bytes() const { return budget_bytes_; }
  uint64_t allocated_bytes() const;
  uint64_t in_use_bytes() const;
  bool pinned() const { return pinned_; }
  /// Every slab allocated so far (for io_uring buffer registration). Stable addresses.
  std::vector<std::pair<std::byte*, uint64_t>> slabs() const;
  /// Changes whenever a slab is allocated or freed. io_uring fixed buffers pin the pages they
  /// were registered with, so a registration made at an older epoch must be redone (a trimmed
  /// and reallocated slab can reuse an address with different pages).
  uint64_t epoch() const;

 private:
  friend class Slab;
  void give_back(std::byte* data);
  /// `populate`: fault every page in now (reserve()), else at first use (acquire()).
  Result<std::byte*> allocate_slab(bool populate);
  void free_slab(std::byte* data);

  uint64_t slab_bytes_;
  uint64_t budget_bytes_;
  bool pinned_;
  Feature pin_;
  const CudaRuntime* cuda_;
  uint64_t pending_ = 0;  // slabs being allocated outside the lock (count against the budget)
  uint64_t epoch_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::byte*> all_;
  std::vector<std::byte*> free_;
};

}  // namespace resilient::memory
