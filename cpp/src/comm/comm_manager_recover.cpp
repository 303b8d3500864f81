// CommManager::recover: the teardown and rebuild steps of the protocol described at the top of
// comm_manager.cpp.
#include <algorithm>
#include <atomic>

#include "resilient/comm/comm_manager.hpp"
#include "resilient/common/logging.hpp"

namespace resilient::comm {

void CommManager::abort_pending_child() {
  NcclComm child = std::atomic_ref<NcclComm>(shrink_child_).exchange(nullptr);
  if (child != nullptr) abort_handle(child);
}

Status CommManager::await_shrink(NcclComm parent, int parent_async_before, TimePoint deadline,
                                 const std::string& what, NcclComm& child) {
  const NcclApi& api = lib_->api();
  const TimePoint start = clock_->now();
  std::atomic_ref<NcclComm> slot(shrink_child_);
  for (;;) {
    child = slot.load(std::memory_order_acquire);
    if (child != nullptr) return poll(child, deadline, what.c_str(), {});
    if (abort_requested_.load()) {
      return Status(StatusCode::kCancelled, what + " cancelled by request_abort()");
    }
    // A child whose init failed is published with its error (polled above). A new error on the
    // parent ends the wait too; one it already reported before the shrink (a shrink-abort of a
    // failed parent) is not news.
    int async = kNcclSuccess;
    int rc = api.comm_get_async_error(parent, &async);
    if (rc != kNcclSuccess) return nccl_error(rc, parent, what + " (async query)");
    if (async != kNcclSuccess && async != kNcclInProgress && async != parent_async_before) {
      // The dead peer may show on the parent just as NCCL publishes a healthy child.
      child = slot.load(std::memory_order_acquire);
      if (child != nullptr) return poll(child, deadline, what.c_str(), {});
      return nccl_error(async, parent, what);
    }
    const TimePoint now = clock_->now();
    if (now >= deadline) {
      return Status(StatusCode::kTimeout, what + " did not complete within " +
                                              std::to_string(to_seconds(now - start)) + " s");
    }
    sleep_(options_.poll_interval);
  }
}

Status CommManager::shrink(const RebuildRequest& request, int new_size, bool abort_parent,
                           RecoveryReport& report) {
  const NcclApi& api = lib_->api();
  std::vector<int> excluded = request.excluded;
  std::sort(excluded.begin(), excluded.end());
  NcclConfig config = make_nccl_config(lib_->version(), /*blocking=*/false);
  const std::string what = "shrink to generation " + std::to_string(request.generation);
  int parent_async = kNcclSuccess;
  if (api.comm_get_async_error(comm_, &parent_async) != kNcclSuccess) parent_async = kNcclSuccess;
  // Non-blocking, NCCL writes the child through this pointer from its own thread when the
  // child's init completes, after ncclCommShrink returned: so it points at a member.
  std::atomic_ref<NcclComm>(shrink_child_).store(nullptr, std::memory_order_release);
  int rc =
      api.comm_shrink(comm_, excluded.data(), static_cast<int>(excluded.size()), &shrink_child_,
                      &config, abort_parent ? kNcclShrinkAbort : kNcclShrinkDefault);
  RESILIENT_LOG(kDebug, "comm: ncclCommShrink(parent " << comm_ << ", " << excluded.size()
                                                       << " excluded) returned " << rc);
  NcclComm child = nullptr;
  Status st =
      (rc == kNcclSuccess || rc == kNcclInProgress)
          ? await_shrink(comm_, parent_async, clock_->now() + options_.init_timeout, what, child)
          : nccl_error(rc, comm_, what);
  RESILIENT_LOG(kDebug, "comm: child " << child << " of the shrink: " << st.to_string());
  int rank = report.new_rank;
  int size = new_size;
  if (st.ok() && (api.comm_user_rank(child, &rank) != kNcclSuccess ||
                  api.comm_count(child, &size) != kNcclSuccess || rank != report.new_rank ||
                  size != new_size)) {
    st = Status(StatusCode::kInternal, what + ": NCCL assigned rank " + std::to_string(rank) + "/" +
                                           std::to_string(size) + ", expected " +
                                           std::to_string(report.new_rank) + "/" +
                                           std::to_string(new_size));
  }
  if (!st.ok()) {
    // The caller aborts the parent, which ends a child init still running, then aborts a child
    // NCCL published meanwhile (abort_pending_child).
    return st;
  }
  // Retire the parent: after a revoke it is quiescent and may be destroyed (finalize is
  // invalid there); otherwise it was stopped by NCCL_SHRINK_ABORT and is aborted.
  if (revoked_) {
    rc = api.comm_destroy(comm_);
    RESILIENT_LOG(kDebug, "comm: ncclCommDestroy(revoked parent " << comm_ << ") returned " << rc);
    if (rc != kNcclSuccess && rc != kNcclInProgress) abort_handle(comm_);
  } else {
    abort_handle(comm_);
  }
  comm_ = child;
  std::atomic_ref<NcclComm>(shrink_child_).store(nullptr, std::memory_order_release);
  revoked_ = false;
  rank_ = report.new_rank;
  size_ = new_size;
  return ok_status();
}

Result<RecoveryReport> CommManager::recover(const RebuildRequest& request, Store* store) {
  abort_requested_.store(false);
  if (size_ <= 0 || rank_ < 0) {
    return Status(StatusCode::kFailedPrecondition, "recover: no communicator was ever built");
  }
  if (attempted_any_ && request.generation <= last_attempted_generation_) {
    return Status(StatusCode::kInvalidArgument,
                  "recover: generation " + std::to_string(request.generation) +
                      " is not newer than " + std::to_string(last_attempted_generation_));
  }
  RESILIENT_ASSIGN_OR_RETURN(int new_rank, survivor_rank(rank_, size_, request.excluded));
  const int survivors = size_ - static_cast<int>(request.excluded.size());
  const int new_size = request.new_size == 0 ? survivors : request.new_size;
  if (new_size < survivors || survivors <= 0) {
    return Status(StatusCode::kInvalidArgument, "recover: new size " + std::to_string(new_size) +
                                                    " with " + std::to_string(survivors) +
                                                    " survivors");
  }
  RESILIENT_ASSIGN_OR_RETURN(RecoveryPlan plan, this->plan(new_size > survivors));
  if (plan.rebuild == Rebuild::kReinit && store == nullptr) {
    return Status(StatusCode::kInvalidArgument, "recover: a fresh init needs a store");
  }
  attempted_any_ = true;
  last_attempted_generation_ = request.generation;

  RecoveryReport report;
  report.generation = request.generation;
  report.old_rank = rank_;
  report.new_rank = new_rank;
  report.new_size = new_size;
  const NcclApi& api = lib_->api();

  const TimePoint t0 = clock_->now();
  switch (plan.teardown) {
    case Teardown::kRevoke: {
      int rc = api.comm_revoke(comm_, 0);
      Status st = (rc == kNcclSuccess || rc == kNcclInProgress)
                      ? poll(comm_, clock_->now() + options_.quiesce_timeout, "revoke", {})
                      : nccl_error(rc, comm_, "ncclCommRevoke");
      RESILIENT_LOG(kDebug, "comm: ncclCommRevoke(" << comm_ << ") returned " << rc
                                                    << ", quiesce: " << st.to_string());
      if (st.ok()) {
        revoked_ = true;
      } else {
        RESILIENT_LOG(kWarn, "comm: " << st.to_string() << "; aborting instead");
        abort_handle(comm_);
        comm_ = nullptr;
        report.fell_back_to_abort = true;
        plan.rebuild = Rebuild::kReinit;
      }
      break;
    }
    case Teardown::kAbort:
      abort_handle(comm_);
      comm_ = nullptr;
      break;
    case Teardown::kShrinkAbort:
    case Teardown::kNone:
      break;
  }
  report.plan = plan;
  report.teardown = clock_->now() - t0;

  const TimePoint t1 = clock_->now();
  Status st;
  if (plan.rebuild == Rebuild::kShrink) {
    st = shrink(request, new_size, plan.teardown == Teardown::kShrinkAbort, report);
  } else if (store == nullptr) {
    st = Status(StatusCode::kUnavailable,
                "revoke did not quiesce and no store was given for a fresh init");
  } else {
    if (comm_ != nullptr) {  // revoked parent: quiescent, so destroy is safe and local.
      int rc = api.comm_destroy(comm_);
      if (rc != kNcclSuccess && rc != kNcclInProgress) abort_handle(comm_);
      comm_ = nullptr;
      revoked_ = false;
    }
    const int old_rank = rank_, old_size = size_;
    st = init_from_store(*store, request.generation, new_size, new_rank);
    if (!st.ok()) {
      rank_ = old_rank;
      size_ = old_size;
    }
  }
  report.rebuild = clock_->now() - t1;
  if (!st.ok()) {
    if (comm_ != nullptr) abort_handle(comm_);
    abort_pending_child();
    comm_ = nullptr;
    revoked_ = false;
    state_ = CommState::kAborted;
    return st.prepend("rebuilding generation " + std::to_string(request.generation) + " (" +
                      teardown_name(plan.teardown) + " + " + rebuild_name(plan.rebuild) + ")");
  }
  generation_ = request.generation;
  state_ = CommState::kReady;
  RESILIENT_LOG(kInfo, "comm: generation " << generation_ << " ready: rank " << rank_ << "/"
                                           << size_ << " via " << teardown_name(plan.teardown)
                                           << " + " << rebuild_name(plan.rebuild) << " in "
                                           << to_seconds(report.teardown + report.rebuild) << " s");
  return report;
}

}  // namespace resilient::comm
