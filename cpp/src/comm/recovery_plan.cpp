#include "resilient/comm/recovery_plan.hpp"

#include <algorithm>
#include <string>

namespace resilient::comm {

const char* teardown_name(Teardown t) {
  switch (t) {
    case Teardown::kNone:
      return "none";
    case Teardown::kRevoke:
      return "revoke";
    case Teardown::kShrinkAbort:
      return "shrink_abort";
    case Teardown::kAbort:
      return "abort";
  }
  return "?";
}

const char* rebuild_name(Rebuild r) {
  switch (r) {
    case Rebuild::kShrink:
      return "shrink";
    case Rebuild::kReinit:
      return "reinit";
  }
  return "?";
}

Result<RecoveryPlan> plan_recovery(const NcclCapabilities& caps, const CommOptions& options,
                                   bool parent_alive, bool has_joiners) {
  if (options.revoke == Feature::kOn && !caps.revoke) {
    return Status(StatusCode::kUnavailable,
                  "RESILIENT_COMM_REVOKE=on but ncclCommRevoke is unavailable (NCCL >= 2.28.7)");
  }
  if (options.rebuild_mode == RebuildMode::kShrink) {
    if (!caps.shrink) {
      return Status(StatusCode::kUnavailable,
                    "RESILIENT_COMM_REBUILD=shrink but ncclCommShrink is unavailable "
                    "(NCCL >= 2.27.0)");
    }
    if (has_joiners) {
      return Status(StatusCode::kFailedPrecondition,
                    "cannot shrink when ranks join; use rebuild mode auto or reinit");
    }
    if (!parent_alive) {
      return Status(StatusCode::kFailedPrecondition,
                    "cannot shrink: the previous communicator was already aborted");
    }
  }
  RecoveryPlan plan;
  if (!parent_alive) {
    plan.teardown = Teardown::kNone;
    plan.rebuild = Rebuild::kReinit;
    return plan;
  }
  const bool shrink = caps.shrink && !has_joiners && options.rebuild_mode != RebuildMode::kReinit;
  plan.rebuild = shrink ? Rebuild::kShrink : Rebuild::kReinit;
  if (caps.revoke && options.revoke != Feature::kOff) {
    plan.teardown = Teardown::kRevoke;
  } else {
    plan.teardown = shrink ? Teardown::kShrinkAbort : Teardown::kAbort;
  }
  return plan;
}

Result<int> survivor_rank(int old_rank, int old_size, const std::vector<int>& excluded) {
  std::vector<int> sorted = excluded;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    return Status(StatusCode::kInvalidArgument, "excluded ranks contain a duplicate");
  }
  for (int r : sorted) {
    if (r < 0 || r >= old_size) {
      return Status(
          StatusCode::kInvalidArgument,
          "excluded rank " + std::to_string(r) + " outside [0, " + std::to_string(old_size) + ")");
    }
  }
  if (std::binary_search(sorted.begin(), sorted.end(), old_rank)) {
    return Status(StatusCode::kInvalidArgument,
                  "rank " + std::to_string(old_rank) + " is itself excluded");
  }
  return old_rank - static_cast<int>(std::lower_bound(sorted.begin(), sorted.end(), old_rank) -
                                     sorted.begin());
}

}  // namespace resilient::comm
