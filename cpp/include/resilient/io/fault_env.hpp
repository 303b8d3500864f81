#pragma once
// A configurable process-wide file fault (chaos testing): make chosen file operations fail with
// an errno, or slow them down, optionally only while a trigger file exists. Built on the
// ScopedFileHook seam, configured by a FaultSpec or by RESILIENT_FAULT_* environment variables
// so that an unmodified training job can be given faults by `resilient chaos`.

#include <cstdint>
#include <string>

#include "resilient/common/status.hpp"

namespace resilient::io {

/// What to inject. A call matches when its op is in `ops`, its path contains `path_contains`
/// (empty: any path) and, if `trigger_file` is set, that file exists at the time of the call.
struct FaultSpec {
  uint32_t ops = 0;           ///< bitmask of 1 << FileOp
  int error = 0;              ///< errno for matching calls (0: do not fail, only delay)
  std::string path_contains;  ///< substring filter on the file's path
  int64_t after = 0;          ///< let this many matching calls through first
  int64_t count = 0;          ///< fail at most this many calls (0: unlimited)
  std::string trigger_file;   ///< active only while this file exists (empty: always)
  double delay_ms = 0;        ///< sleep this long in every matching call (slow storage)
};

/// Parses RESILIENT_FAULT_OPS ("write,fsync"), RESILIENT_FAULT_ERRNO ("EIO", "ENOSPC" or a
/// number; default EIO), RESILIENT_FAULT_PATH, RESILIENT_FAULT_AFTER, RESILIENT_FAULT_COUNT,
/// RESILIENT_FAULT_TRIGGER and RESILIENT_FAULT_DELAY_MS. Returns a spec with ops == 0 when
/// RESILIENT_FAULT_OPS is unset. Errors: kInvalidArgument for an unknown op or errno name.
Result<FaultSpec> fault_spec_from_env();

/// Installs `spec` as the process's file hook, replacing a previous fault hook.
/// Errors: kFailedPrecondition if a ScopedFileHook of a test is already installed.
/// Thread safety: call from one thread at a time.
Status install_fault_hook(const FaultSpec& spec);

/// Removes the fault hook (no-op without one). Returns how many calls it failed or delayed.
int64_t clear_fault_hook();

/// Calls the installed fault hook has failed or delayed so far (0 without one).
int64_t fault_hook_hits();

}  // namespace resilient::io
