#pragma once
// Pure decisions of communicator recovery: how to tear the failed communicator down and how to
// build the next one, from the library's capabilities, the settings and the manager's state.

#include <vector>

#include "resilient/comm/options.hpp"
#include "resilient/common/status.hpp"

namespace resilient::comm {

/// What the loaded NCCL can do (NcclLibrary::supports, collected).
struct NcclCapabilities {
  bool shrink = false;
  bool revoke = false;
};

/// How the failed communicator is stopped.
enum class Teardown {
  kNone,         ///< nothing left to stop (it was already aborted, e.g. a failed rebuild).
  kRevoke,       ///< ncclCommRevoke, wait until quiescent, later ncclCommDestroy.
  kShrinkAbort,  ///< ncclCommShrink with NCCL_SHRINK_ABORT, then ncclCommAbort of the parent.
  kAbort,        ///< ncclCommAbort.
};
/// How the next communicator is built.
enum class Rebuild {
  kShrink,  ///< ncclCommShrink of the parent, excluding the failed ranks.
  kReinit,  ///< ncclCommInitRankConfig with a new unique id from the store (new generation).
};

struct RecoveryPlan {
  Teardown teardown = Teardown::kAbort;
  Rebuild rebuild = Rebuild::kReinit;
  bool operator==(const RecoveryPlan&) const = default;
};

const char* teardown_name(Teardown t);
const char* rebuild_name(Rebuild r);

/// Chooses the recovery. `parent_alive`: the failed communicator still exists (not aborted);
/// `has_joiners`: the new membership adds ranks (spares, restarts), which only a fresh init can.
/// Errors: Unavailable when the options demand a feature the library lacks
/// (rebuild_mode=shrink without ncclCommShrink, revoke=ON without ncclCommRevoke), or
/// FailedPrecondition when shrink is demanded but impossible (joiners, parent gone).
Result<RecoveryPlan> plan_recovery(const NcclCapabilities& caps, const CommOptions& options,
                                   bool parent_alive, bool has_joiners);

/// The rank `old_rank` gets once `excluded` (ranks of the old communicator) are removed: ranks
/// keep their order and close the gaps, as ncclCommShrink does. Errors: InvalidArgument when
/// `old_rank` is excluded, or `excluded` has a rank outside [0, old_size) or a duplicate.
Result<int> survivor_rank(int old_rank, int old_size, const std::vector<int>& excluded);

}  // namespace resilient::comm
