#pragma once
// Cross-rank straggler scoring and the stateful detector that turns per-window scores into
// reports. The monitor (Python) summarises each rank's step timings over a window of `interval`
// steps, all-gathers one small row per rank, and every rank feeds the same matrix to its own
// StragglerDetector, so all ranks reach the same verdict without another exchange.
//
// Scoring of one window, per phase, over the ranks that measured it:
//   compute, host: ratio = value / median, z = (value - median) / scale
//   wait:          the straggler is the rank that waits LEAST (the others wait for it), so
//                  z = (median - value) / scale and ratio is the implied busy-time ratio
//                  (median_step - value) / (median_step - median_wait)
// with scale = max(1.4826 * MAD, mad_floor * median). A phase is slow when
//   ratio >= slow_ratio, or (z >= z_threshold and ratio >= min_ratio),
// and in both cases its excess over the median is at least min_step_fraction of the median step.
// The wait phase only corroborates (the collective's own duration is noisy across ranks): it is
// slow only on the z rule, and only when the host phase's ratio is also >= min_ratio.
// A rank is slow in a window when any phase is; its worst phase is the slow phase with the largest
// ratio, compute and host taking precedence over wait. A rank is reported while slow, once slow for
// report_after consecutive windows. Persistence comes from a CUSUM per rank (cusum.hpp) fed with
// log(ratio) / log(min_ratio) for slow windows and 0 otherwise.

#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "resilient/common/status.hpp"
#include "resilient/straggler/cusum.hpp"
#include "resilient/straggler/options.hpp"
#include "resilient/straggler/stats.hpp"

namespace resilient::straggler {

enum class Phase : int { kCompute = 0, kHost = 1, kWait = 2 };
inline constexpr int kNumPhases = 3;
inline constexpr double kNotMeasured = std::numeric_limits<double>::quiet_NaN();

/// "compute", "host" or "wait".
const char* phase_name(Phase phase);

/// One rank's summary of one window: typical (median) seconds per step for each phase, NaN where
/// the phase was not measured, and the typical step wall time.
struct RankWindow {
  std::array<double, kNumPhases> phase_s{kNotMeasured, kNotMeasured, kNotMeasured};
  double step_s = kNotMeasured;
  int64_t steps = 0;  ///< Steps summarised; a rank with 0 is not scored in this window.
};

/// The all-gathered summaries of one window; `ranks[r]` is rank r.
struct WindowInput {
  int64_t first_step = 0;
  int64_t last_step = 0;
  std::vector<RankWindow> ranks;
};

struct PhaseScore {
  double value = kNotMeasured;   ///< This rank's seconds per step.
  double median = kNotMeasured;  ///< Cross-rank median of the phase.
  double ratio = kNotMeasured;   ///< Slowdown versus the median (>1 = slower).
  double z = 0.0;                ///< Robust z-score, positive = slower.
  bool slow = false;
};

/// One rank's scores in one window (the per-rank timeline of the demo).
struct RankScore {
  int rank = 0;
  std::array<PhaseScore, kNumPhases> phases;
  Phase worst_phase =
      Phase::kCompute;          ///< Slow phase with the largest ratio (wait last), else max z.
  double ratio = kNotMeasured;  ///< Ratio of the worst phase.
  double z = 0.0;               ///< z of the worst phase.
  bool slow = false;
  double evidence = 0.0;             ///< CUSUM input of this window.
  double cusum = 0.0;                ///< CUSUM after this window.
  bool persistent = false;           ///< In a persistent excursion after this window.
  double self_ratio = kNotMeasured;  ///< Worst phase versus this rank's own recent baseline.
  int64_t slow_streak = 0;           ///< Consecutive slow windows up to this one.
};

/// A named straggler with its evidence.
struct StragglerReport {
  int rank = 0;
  Phase phase = Phase::kCompute;
  double ratio = kNotMeasured;  ///< How much slower than the median, e.g. 1.23.
  double z = 0.0;
  double value_s = kNotMeasured;     ///< This rank's seconds per step in that phase.
  double median_s = kNotMeasured;    ///< The cross-rank median of that phase.
  double self_ratio = kNotMeasured;  ///< Versus this rank's own baseline (NaN until known).
  int64_t since_step = 0;            ///< Estimated change point (first step of the excursion).
  int64_t last_step = 0;             ///< Last step of the window that produced the report.
  bool persistent = false;           ///< false: transient so far.
  double cusum = 0.0;
  int64_t flagged_windows = 0;  ///< Slow windows in the current excursion.
  int64_t slow_streak = 0;      ///< Consecutive slow windows up to this one.

  /// "rank 2 persistent straggler: compute 1.52x median (z=9.1, 12.0 ms vs 7.9 ms) since step 40"
  std::string to_string() const;
};

struct WindowResult {
  int64_t window = 0;  ///< 0-based index of the window.
  int64_t first_step = 0;
  int64_t last_step = 0;
  std::vector<RankScore> scores;  ///< One per rank, index = rank.
  /// Ranks slow in this window and either slow for report_after consecutive windows or in a
  /// persistent excursion.
  std::vector<StragglerReport> reports;
  std::vector<int> newly_persistent;  ///< Ranks that turned persistent in this window.
  std::vector<int> recovered;         ///< Ranks whose persistent excursion ended.
};

/// Cross-rank scores of one window, without history (evidence/cusum/self_ratio left default).
/// @returns kInvalidArgument for an empty input or first_step > last_step. Pure.
Result<std::vector<RankScore>> score_window(const WindowInput& input,
                                            const StragglerOptions& options);

/// Stateful detector: cross-rank scores, each rank's own baseline, and persistence.
/// Thread-compatible (one owner; the monitor calls it from the training thread).
class StragglerDetector {
 public:
  /// @returns kInvalidArgument for invalid options or world_size < 1.
  static Result<StragglerDetector> create(const StragglerOptions& options, int world_size);

  /// Scores one window and advances the per-rank state.
  /// @returns kInvalidArgument when input.ranks.size() != world_size or steps go backwards.
  Result<WindowResult> update(const WindowInput& input);

  const StragglerOptions& options() const { return options_; }
  int world_size() const { return world_size_; }
  int64_t windows() const { return windows_; }
  /// @param rank in [0, world_size) (RESILIENT_CHECK).
  const CusumState& cusum_state(int rank) const;
  /// Forgets all history (e.g. after the job re-formed with different ranks).
  void reset();

 private:
  StragglerDetector(const StragglerOptions& options, int world_size);

  struct RankState {
    CusumState cusum;
    int64_t slow_streak = 0;
    std::vector<RollingHistory> baseline;  // one per phase; only non-slow windows are pushed
  };

  StragglerOptions options_;
  int world_size_;
  int64_t windows_ = 0;
  int64_t last_step_ = -1;
  std::vector<RankState> ranks_;
};

}  // namespace resilient::straggler
