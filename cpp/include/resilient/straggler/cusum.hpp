#pragma once
// One-sided CUSUM (Page's cumulative sum) change-point detector. A straggler's per-window evidence
// accumulates; a single slow window (a GC pause, a checkpoint write) decays away, while a shift
// that lasts several windows crosses the threshold. The start of the current excursion above zero
// is the estimated change point ("slow since step N").

#include <cstdint>

namespace resilient::straggler {

/// Parameters of the detector. Invariants (checked by StragglerOptions::validate): drift > 0,
/// threshold > 0, clip > drift, cap >= threshold.
struct CusumParams {
  double drift = 0.5;  ///< Subtracted every window: the evidence a window must exceed to grow S.
  double threshold = 5.0;  ///< S >= threshold: the shift is persistent.
  double clip = 2.0;  ///< Per-window evidence is clipped to [0, clip]: no single window alarms.
  double cap = 10.0;  ///< S is capped so recovery after a long episode takes bounded time.
};

/// State of one detector (one rank). Plain value; copy it to branch.
struct CusumState {
  double sum = 0.0;             ///< S_t.
  int64_t run_start = -1;       ///< First step of the current excursion (S > 0), -1 when S == 0.
  bool persistent = false;      ///< Crossed the threshold during the current excursion.
  int64_t flagged_windows = 0;  ///< Windows with positive evidence in the current excursion.
};

/// What one update changed.
struct CusumEvent {
  bool became_persistent = false;  ///< Crossed the threshold in this update.
  bool recovered = false;          ///< S returned to 0 after a persistent excursion.
};

/// S_t = min(cap, max(0, S_{t-1} + min(evidence, clip) - drift)).
/// @param state updated in place.
/// @param evidence non-negative evidence of this window (0 = looked normal); negative counts as 0.
/// @param window_first_step first training step of the window (recorded as the change point when
///        an excursion starts).
/// @returns the transitions caused by this update. Pure apart from `state`; thread-compatible.
CusumEvent cusum_update(CusumState& state, double evidence, int64_t window_first_step,
                        const CusumParams& params);

}  // namespace resilient::straggler
