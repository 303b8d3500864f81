#pragma once
// Settings of the communicator manager. Each has a typed default and a RESILIENT_COMM_* override
// (docs/SETTINGS.md); Python sets them through resilient.comm.CommOptions.

#include <string>
#include <string_view>

#include "resilient/common/clock.hpp"
#include "resilient/common/config.hpp"
#include "resilient/common/status.hpp"

namespace resilient::comm {

/// How a failed communicator is rebuilt.
enum class RebuildMode {
  kAuto,    ///< ncclCommShrink when the library has it and no rank joins, else a fresh init.
  kShrink,  ///< always shrink; an error when the library lacks ncclCommShrink.
  kReinit,  ///< always a fresh init with a new unique id exchanged through the store.
};

/// "auto" | "shrink" | "reinit". Errors: InvalidArgument.
Result<RebuildMode> parse_rebuild_mode(std::string_view text);
const char* rebuild_mode_name(RebuildMode mode);

/// Communicator manager settings. Plain value; thread-compatible.
struct CommOptions {
  /// RESILIENT_COMM_INIT_TIMEOUT_S: deadline for a (non-blocking) init or shrink to complete.
  Duration init_timeout = std::chrono::seconds(120);
  /// RESILIENT_COMM_COLLECTIVE_TIMEOUT_S: deadline for a collective to be enqueued and for
  /// wait() when no timeout is passed.
  Duration collective_timeout = std::chrono::seconds(60);
  /// RESILIENT_COMM_QUIESCE_TIMEOUT_S: deadline for a revoked communicator to become quiescent;
  /// past it the manager aborts instead.
  Duration quiesce_timeout = std::chrono::seconds(10);
  /// RESILIENT_COMM_STORE_TIMEOUT_S: deadline for reading a peer's unique id from the store.
  Duration store_timeout = std::chrono::seconds(120);
  /// RESILIENT_COMM_POLL_INTERVAL_US: sleep between ncclCommGetAsyncError polls.
  Duration poll_interval = std::chrono::microseconds(200);
  /// RESILIENT_COMM_REBUILD: auto | shrink | reinit.
  RebuildMode rebuild_mode = RebuildMode::kAuto;
  /// RESILIENT_COMM_REVOKE: AUTO uses ncclCommRevoke when NCCL >= 2.28.7; OFF always aborts;
  /// ON makes an older NCCL an error at recovery.
  Feature revoke = Feature::kAuto;
  /// RESILIENT_COMM_NAME: namespace of this communicator's store keys.
  std::string name = "default";

  /// Defaults overridden by the RESILIENT_COMM_* variables, then validate()d.
  /// Errors: kInvalidArgument naming a malformed variable or an out-of-range value.
  static Result<CommOptions> from_env();

  /// kInvalidArgument naming the first bad field (and its variable): every timeout must be
  /// > 0, poll_interval >= 0, name non-empty.
  Status validate() const;
};

}  // namespace resilient::comm
