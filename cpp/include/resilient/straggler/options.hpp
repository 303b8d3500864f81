#pragma once
// Settings of the straggler detector. Every field has a typed default and a RESILIENT_STRAGGLER_*
// environment override (from_env); docs/SETTINGS.md lists them.

#include <cstdint>

#include "resilient/common/status.hpp"
#include "resilient/straggler/cusum.hpp"

namespace resilient::straggler {

struct StragglerOptions {
  /// Steps per aggregation window: the monitor exchanges one small summary every `interval` steps
  /// (RESILIENT_STRAGGLER_INTERVAL).
  int64_t interval = 10;
  /// "Slower than N x the median" rule: a phase this much slower than the cross-rank median is
  /// slow regardless of spread (RESILIENT_STRAGGLER_SLOW_RATIO).
  double slow_ratio = 1.5;
  /// A phase is also slow when its robust z-score >= z_threshold AND its ratio to the median is
  /// >= min_ratio (RESILIENT_STRAGGLER_Z_THRESHOLD, RESILIENT_STRAGGLER_MIN_RATIO).
  double z_threshold = 3.5;
  double min_ratio = 1.1;
  /// Floor of the z-score denominator as a fraction of the median (RESILIENT_STRAGGLER_MAD_FLOOR).
  double mad_floor = 0.02;
  /// A slow phase's excess over the median must also be at least this fraction of the median step
  /// wall time, so jitter in a phase that is a sliver of the step is not called a straggler
  /// (RESILIENT_STRAGGLER_MIN_STEP_FRACTION). Ignored when step times are not known.
  double min_step_fraction = 0.02;
  /// Fewest ranks reporting a phase for it to be scored across ranks
  /// (RESILIENT_STRAGGLER_MIN_RANKS); below 3 the median says little.
  int64_t min_ranks = 3;
  /// Windows kept per rank as its own baseline (RESILIENT_STRAGGLER_HISTORY).
  int64_t history_windows = 32;
  /// Consecutive slow windows before a rank is reported (RESILIENT_STRAGGLER_REPORT_AFTER). One
  /// slow window (a GC pause, the OS scheduling another job on the host) shows in the scores but is
  /// not reported; a persistent rank is reported regardless.
  int64_t report_after = 3;
  /// Persistence detector (RESILIENT_STRAGGLER_CUSUM_DRIFT, _CUSUM_THRESHOLD, _CUSUM_CLIP,
  /// _CUSUM_CAP).
  CusumParams cusum;

  /// Defaults overridden by the environment. Errors: kInvalidArgument naming a malformed
  /// variable. Fields are checked together by validate(), which the detector calls at creation
  /// (after the caller's own overrides).
  static Result<StragglerOptions> from_env();

  /// kInvalidArgument naming the first inconsistent field (e.g. slow_ratio < min_ratio).
  Status validate() const;
};

}  // namespace resilient::straggler
