// Recovery protocol (every survivor runs the same steps with the same RebuildRequest, which the
// caller agrees on beforehand, e.g. through the detector's membership):
//   1. Teardown of the failed communicator, chosen by plan_recovery():
//      - revoke (NCCL >= 2.28.7): ncclCommRevoke stops in-flight work; the communicator reports
//        ncclInProgress until quiescent, which we poll up to quiesce_timeout. If it does not
//        quiesce, we abort it and fall back to a fresh init.
//      - shrink-abort (shrink without revoke): ncclCommShrink with NCCL_SHRINK_ABORT terminates
//        the parent's operations as part of the shrink.
//      - abort: ncclCommAbort.
//   2. Rebuild:
//      - shrink: ncclCommShrink(parent, excluded), non-blocking. NCCL writes the child through
//        the output pointer from its own thread once the child's init completes (the call itself
//        may return with it still null), so the pointer is a member and we wait for it up to
//        init_timeout; a child whose init failed is published too, carrying the error. Then the
//        parent is destroyed (after revoke; finalize is invalid there) or aborted.
//      - reinit: new rank 0 publishes a fresh unique id under gen<g>; everyone (including spares
//        and restarted ranks, through init_from_store) inits the new communicator.
//   3. A failure during step 2 (a second rank dies) aborts both communicators and leaves the
//      manager in kAborted with the old ranks, so the caller retries with the union of the
//      excluded ranks and a newer generation; the retry is always a fresh init.
#include "resilient/comm/comm_manager.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include "resilient/common/logging.hpp"

namespace resilient::comm {

const char* comm_state_name(CommState s) {
  switch (s) {
    case CommState::kEmpty:
      return "empty";
    case CommState::kReady:
      return "ready";
    case CommState::kFailed:
      return "failed";
    case CommState::kAborted:
      return "aborted";
  }
  return "?";
}

CommManager::CommManager(std::shared_ptr<const NcclLibrary> lib, CommOptions options,
                         const Clock* clock, Sleeper sleep)
    : lib_(std::move(lib)), options_(std::move(options)), clock_(clock), sleep_(std::move(sleep)) {
  RESILIENT_CHECK(lib_ != nullptr, "CommManager needs an NcclLibrary");
  RESILIENT_CHECK(clock_ != nullptr, "CommManager needs a clock");
  if (!sleep_) sleep_ = [](Duration d) { std::this_thread::sleep_for(d); };
}

CommManager::~CommManager() {
  if (comm_ != nullptr) abort_handle(comm_);
  abort_pending_child();
}

Status CommManager::nccl_error(int rc, NcclComm comm, const std::string& what) const {
  StatusCode code = StatusCode::kInternal;
  switch (rc) {
    case kNcclRemoteError:
    case kNcclSystemError:
    case kNcclUnhandledCudaError:
      code = StatusCode::kUnavailable;
      break;
    case kNcclInvalidArgument:
      code = StatusCode::kInvalidArgument;
      break;
    default:
      break;
  }
  return Status(code, what + ": " + lib_->describe(rc, comm));
}

void CommManager::abort_handle(NcclComm comm) {
  RESILIENT_LOG(kDebug, "comm: ncclCommAbort(" << comm << ")");
  int rc = lib_->api().comm_abort(comm);
  if (rc != kNcclSuccess && rc != kNcclInProgress) {
    RESILIENT_LOG(kWarn, "comm: ncclCommAbort returned " << lib_->describe(rc));
  }
}

Status CommManager::poll(NcclComm comm, TimePoint deadline, const char* what,
                         const DoneQuery& done) {
  const NcclApi& api = lib_->api();
  const TimePoint start = clock_->now();
  for (;;) {
    if (abort_requested_.load()) {
      return Status(StatusCode::kCancelled, std::string(what) + " cancelled by request_abort()");
    }
    int async = kNcclSuccess;
    int rc = api.comm_get_async_error(comm, &async);
    if (rc != kNcclSuccess) return nccl_error(rc, comm, std::string(what) + " (async query)");
    if (async != kNcclSuccess && async != kNcclInProgress) return nccl_error(async, comm, what);
    if (async == kNcclSuccess) {
      if (!done) return ok_status();
      Result<bool> finished = done();
      if (!finished.ok()) return finished.status();
      if (*finished) return ok_status();
    }
    const TimePoint now = clock_->now();
    if (now >= deadline) {
      return Status(StatusCode::kTimeout, std::string(what) + " did not complete within " +
                                              std::to_string(to_seconds(now - start)) + " s");
    }
    sleep_(options_.poll_interval);
  }
}

Result<NcclUniqueId> CommManager::new_unique_id() const {
  NcclUniqueId id{};
  int rc = lib_->api().get_unique_id(&id);
  if (rc != kNcclSuccess) return nccl_error(rc, nullptr, "ncclGetUniqueId");
  return id;
}

Status CommManager::init(const NcclUniqueId& id, int nranks, int rank, uint64_t generation) {
  if (comm_ != nullptr) {
    return Status(StatusCode::kFailedPrecondition, "init: a communicator already exists");
  }
  if (nranks <= 0 || rank < 0 || rank >= nranks) {
    return Status(StatusCode::kInvalidArgument, "init: rank " + std::to_string(rank) +
                                                    " outside [0, " + std::to_string(nranks) + ")");
  }
  abort_requested_.store(false);
  attempted_any_ = true;
  last_attempted_generation_ = std::max(last_attempted_generation_, generation);
  const std::string what = "init of generation " + std::to_string(generation) + " (rank " +
                           std::to_string(rank) + "/" + std::to_string(nranks) + ")";
  NcclConfig config = make_nccl_config(lib_->version(), /*blocking=*/false);
  NcclComm c = nullptr;
  int rc = lib_->api().comm_init_rank_config(&c, nranks, id, rank, &config);
  Status st;
  if (rc != kNcclSuccess && rc != kNcclInProgress) {
    st = nccl_error(rc, c, what);
  } else if (c == nullptr) {
    st = Status(StatusCode::kInternal, what + ": NCCL returned no communicator");
  } else {
    st = poll(c, clock_->now() + options_.init_timeout, what.c_str(), {});
  }
  if (!st.ok()) {
    if (c != nullptr) abort_handle(c);
    return st;
  }
  comm_ = c;
  revoked_ = false;
  rank_ = rank;
  size_ = nranks;
  generation_ = generation;
  state_ = CommState::kReady;
  return ok_status();
}

std::string CommManager::id_key(uint64_t generation) const {
  return "resilient/comm/" + options_.name + "/gen" + std::to_string(generation) + "/nccl_id";
}

Status CommManager::init_from_store(Store& store, uint64_t generation, int nranks, int rank) {
  NcclUniqueId id{};
  const std::string key = id_key(generation);
  if (rank == 0) {
    RESILIENT_ASSIGN_OR_RETURN(id, new_unique_id());
    RESILIENT_RETURN_IF_ERROR(
        store.set(key, std::string(id.internal, sizeof(id.internal)), options_.store_timeout));
  } else {
    RESILIENT_ASSIGN_OR_RETURN(std::string bytes,
                               store.get(key, options_.store_timeout, IfAbsent::kWait));
    if (bytes.size() != sizeof(id.internal)) {
      return Status(StatusCode::kCorrupt, "store key " + key + " holds " +
                                              std::to_string(bytes.size()) +
                                              " bytes, not a 128-byte NCCL unique id");
    }
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }
  return init(id, nranks, rank, generation);
}

Status CommManager::all_reduce(const void* send, void* recv, size_t count, NcclDataType dtype,
                               NcclRedOp op, void* stream) {
  if (state_ != CommState::kReady) {
    return Status(StatusCode::kFailedPrecondition,
                  std::string("all_reduce on a communicator that is ") + comm_state_name(state_));
  }
  int rc = lib_->api().all_reduce(send, recv, count, static_cast<int>(dtype), static_cast<int>(op),
                                  comm_, stream);
  Status st;
  if (rc == kNcclInProgress) {
    st = poll(comm_, clock_->now() + options_.collective_timeout, "all_reduce enqueue", {});
  } else if (rc != kNcclSuccess) {
    st = nccl_error(rc, comm_, "ncclAllReduce");
  }
  if (!st.ok()) state_ = CommState::kFailed;
  return st;
}

Status CommManager::broadcast(const void* send, void* recv, size_t count, NcclDataType dtype,
                              int root, void* stream) {
  if (state_ != CommState::kReady) {
    return Status(StatusCode::kFailedPrecondition,
                  std::string("broadcast on a communicator that is ") + comm_state_name(state_));
  }
  int rc = lib_->api().broadcast(send, recv, count, static_cast<int>(dtype), root, comm_, stream);
  Status st;
  if (rc == kNcclInProgress) {
    st = poll(comm_, clock_->now() + options_.collective_timeout, "broadcast enqueue", {});
  } else if (rc != kNcclSuccess) {
    st = nccl_error(rc, comm_, "ncclBroadcast");
  }
  if (!st.ok()) state_ = CommState::kFailed;
  return st;
}

Status CommManager::wait(const DoneQuery& done, Duration timeout) {
  if (state_ != CommState::kReady) {
    return Status(StatusCode::kFailedPrecondition,
                  std::string("wait on a communicator that is ") + comm_state_name(state_));
  }
  Status st = poll(comm_, clock_->now() + timeout, "collective", done);
  if (!st.ok()) state_ = CommState::kFailed;
  return st;
}

Status CommManager::check() {
  if (comm_ == nullptr) {
    return Status(StatusCode::kFailedPrecondition, "check: no communicator");
  }
  int async = kNcclSuccess;
  int rc = lib_->api().comm_get_async_error(comm_, &async);
  Status st;
  if (rc != kNcclSuccess) {
    st = nccl_error(rc, comm_, "ncclCommGetAsyncError");
  } else if (async != kNcclSuccess && async != kNcclInProgress) {
    st = nccl_error(async, comm_, "communicator");
  }
  if (!st.ok()) state_ = CommState::kFailed;
  return st;
}

Status CommManager::abort() {
  if (comm_ != nullptr) {
    abort_handle(comm_);
    comm_ = nullptr;
    revoked_ = false;
    state_ = CommState::kAborted;
  }
  return ok_status();
}

Result<RecoveryPlan> CommManager::plan(bool has_joiners) const {
  NcclCapabilities caps{lib_->supports(NcclFeature::kShrink), lib_->supports(NcclFeature::kRevoke)};
  return plan_recovery(caps, options_, comm_ != nullptr, has_joiners);
}

}  // namespace resilient::comm
