#pragma once
// CommManager: one NCCL communicator, created non-blocking (config.blocking = 0) so that init,
// collectives and teardown are polled with resilient's own deadlines through
// ncclCommGetAsyncError, and rebuilt after a failure for a new membership (revoke or abort, then
// shrink or a fresh init under a new generation). See docs/comm.md for the protocol.

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "resilient/comm/nccl_api.hpp"
#include "resilient/comm/options.hpp"
#include "resilient/comm/recovery_plan.hpp"
#include "resilient/common/store.hpp"
#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"

namespace resilient::comm {

enum class CommState {
  kEmpty,    ///< no communicator yet (or the last init failed and was cleaned up).
  kReady,    ///< initialized; collectives may be issued.
  kFailed,   ///< a collective or wait reported an error or timed out; recover() next.
  kAborted,  ///< the communicator was aborted (explicitly or by a failed rebuild).
};
const char* comm_state_name(CommState s);

/// The new membership after a failure. Ranks are those of the current (failed) communicator.
struct RebuildRequest {
  /// Must be greater than every generation attempted before (each attempt publishes its own
  /// unique id under "gen<generation>", so a retry after a second failure needs a new one).
  uint64_t generation = 0;
  /// Ranks of the failed communicator that leave (dead or frozen), as agreed by all survivors.
  std::vector<int> excluded;
  /// World size of the new communicator; 0 means the survivors only. Larger than the number
  /// of survivors when spares or restarted ranks join (they call init_from_store with ranks
  /// survivors..new_size-1); that forces a fresh init.
  int new_size = 0;
};

/// What recover() did and how long each phase took (for the recovery timeline).
struct RecoveryReport {
  RecoveryPlan plan;
  uint64_t generation = 0;
  int old_rank = -1;
  int new_rank = -1;
  int new_size = 0;
  Duration teardown{0};  ///< revoke + quiesce, or abort.
  Duration rebuild{0};   ///< shrink or store exchange + init, until the new comm is ready.
  bool fell_back_to_abort = false;  ///< revoke did not quiesce in time; the parent was aborted.
};

/// Returns true when the work being waited for is complete (e.g. a CUDA event query).
using DoneQuery = std::function<Result<bool>()>;
/// Sleeps for a duration; tests inject one that advances a ManualClock.
using Sleeper = std::function<void(Duration)>;

/// Owns at most one NCCL communicator and its generation.
///
/// Thread safety: externally synchronized (one thread drives it), except request_abort(), which
/// any thread may call to make the current or next poll loop return Cancelled.
/// The NcclLibrary is kept alive by the manager; the destructor aborts a live communicator
/// (never waits for peers).
class CommManager {
 public:
  /// `clock` must outlive the manager; `sleep` defaults to std::this_thread::sleep_for.
  CommManager(std::shared_ptr<const NcclLibrary> lib, CommOptions options,
              const Clock* clock = &SteadyClock::instance(), Sleeper sleep = {});
  ~CommManager();
  CommManager(const CommManager&) = delete;
  CommManager& operator=(const CommManager&) = delete;

  /// A fresh unique id (ncclGetUniqueId). Errors: Unavailable/Internal from NCCL.
  Result<NcclUniqueId> new_unique_id() const;

  /// Creates the communicator non-blocking and polls until ready or options.init_timeout.
  /// Errors: FailedPrecondition when a communicator already exists; Timeout (the half-built
  /// communicator is aborted); Unavailable/Internal for NCCL errors (also aborted).
  Status init(const NcclUniqueId& id, int nranks, int rank, uint64_t generation = 0);

  /// init() with the unique id exchanged through `store` under
  /// "resilient/comm/<name>/gen<generation>/nccl_id": rank 0 creates and sets it, the others
  /// wait up to options.store_timeout. This is also how a spare or restarted rank joins.
  /// Errors: as init(), plus Timeout/Unavailable from the store and Corrupt for a bad id.
  Status init_from_store(Store& store, uint64_t generation, int nranks, int rank);

  /// Enqueues an all-reduce on `stream` (a cudaStream_t; nullptr = default stream) and waits,
  /// up to options.collective_timeout, only until NCCL has enqueued it; use wait() for
  /// completion. Errors: FailedPrecondition unless ready; Timeout; Unavailable for a peer
  /// failure (state becomes kFailed).
  Status all_reduce(const void* send, void* recv, size_t count, NcclDataType dtype, NcclRedOp op,
                    void* stream);
  /// Broadcast from `root` (e.g. state to a joining rank); semantics as all_reduce().
  Status broadcast(const void* send, void* recv, size_t count, NcclDataType dtype, int root,
                   void* stream);

  /// Polls the communicator's async error and `done` until `done` returns true, an error, or
  /// `timeout` passes (Timeout). Any error or timeout sets state kFailed. `done` may be empty
  /// (then only the async error is checked once per poll until the communicator is idle).
  Status wait(const DoneQuery& done, Duration timeout);

  /// One poll of ncclCommGetAsyncError: OK, or the error (state becomes kFailed).
  Status check();

  /// Aborts the communicator now (ncclCommAbort). Idempotent; state becomes kAborted.
  Status abort();

  /// Any thread: the current or next poll loop returns Cancelled (a detector's verdict).
  /// Cleared by recover() and init().
  void request_abort() { abort_requested_.store(true); }

  /// Tears the failed communicator down and builds the next one for `request` (see
  /// plan_recovery). `store` is needed for a fresh init and may be null otherwise.
  /// Errors: InvalidArgument (bad ranks, generation not newer, this rank excluded, no store for
  /// a reinit); Unavailable (a feature the options demand); any error of the rebuild itself —
  /// a second failure — after which the old and new communicators are aborted (state kAborted,
  /// ranks still those of the old communicator) so the caller can retry with more exclusions and
  /// a newer generation (a fresh init then).
  Result<RecoveryReport> recover(const RebuildRequest& request, Store* store);

  /// The plan recover() would use now for `has_joiners` (for logs and tests).
  Result<RecoveryPlan> plan(bool has_joiners) const;

  CommState state() const { return state_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t generation() const { return generation_; }
  /// The raw communicator (nullptr when none); valid until the next recover()/abort().
  NcclComm handle() const { return comm_; }
  const NcclLibrary& library() const { return *lib_; }
  const CommOptions& options() const { return options_; }

 private:
  Status poll(NcclComm comm, TimePoint deadline, const char* what, const DoneQuery& done);
  Status nccl_error(int rc, NcclComm comm, const std::string& what) const;
  void abort_handle(NcclComm comm);
  Status shrink(const RebuildRequest& request, int new_size, bool abort_parent,
                RecoveryReport& report);
  Status await_shrink(NcclComm parent, int parent_async_before, TimePoint deadline,
                      const std::string& what, NcclComm& child);
  void abort_pending_child();
  std::string id_key(uint64_t generation) const;

  std::shared_ptr<const NcclLibrary> lib_;
  CommOptions options_;
  const Clock* clock_;
  Sleeper sleep_;
  NcclComm comm_ = nullptr;
  // Where a non-blocking ncclCommShrink publishes its child, from NCCL's thread, when the
  // child's init completes (after the call returned); read through std::atomic_ref.
  alignas(std::atomic_ref<NcclComm>::required_alignment) NcclComm shrink_child_ = nullptr;
  // NCCL stores it with __atomic builtins; our std::atomic_ref must be the same plain store.
  static_assert(std::atomic_ref<NcclComm>::is_always_lock_free);
  bool revoked_ = false;
  CommState state_ = CommState::kEmpty;
  int rank_ = -1;
  int size_ = 0;
  uint64_t generation_ = 0;
  bool attempted_any_ = false;
  uint64_t last_attempted_generation_ = 0;
  std::atomic<bool> abort_requested_{false};
};

}  // namespace resilient::comm
