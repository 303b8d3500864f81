#pragma once
// Hang watchdog: decides from (now, step counter, section) whether training stopped progressing.
// The limit in the "step" section is learned: the largest recent step duration times a safety
// factor, never below min_step_limit. Before `warmup_steps` steps have been seen the "startup"
// limit applies; named sections (e.g. "checkpoint") have their own fixed limits. Every limit can
// be overridden. Pure and thread-compatible: the agent calls it from its own thread.

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>

#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"

namespace resilient::detect {

struct WatchdogOptions {
  double safety_factor = 5.0;
  Duration min_step_limit = std::chrono::seconds(30);
  /// When > 0, replaces the learned step limit.
  Duration step_limit_override = Duration::zero();
  Duration startup_limit = std::chrono::seconds(600);
  /// Fixed limits of named sections; a section not listed uses the step limit.
  std::map<std::string, Duration> section_limits = {{"checkpoint", std::chrono::seconds(1800)}};
  int warmup_steps = 2;
  size_t window = 50;

  /// Defaults with RESILIENT_DETECT_HANG_* overrides, then validate()d.
  /// Errors: kInvalidArgument naming a malformed variable or an out-of-range value.
  static Result<WatchdogOptions> from_env();

  /// kInvalidArgument naming the first bad field: safety_factor >= 1, every limit >= 0
  /// (step_limit_override 0 means learned), window >= 1, warmup_steps >= 0.
  Status validate() const;
};

struct Hang {
  std::string section;
  Duration stalled;  ///< time since the last progress (or section entry)
  Duration limit;
};

class HangWatchdog {
 public:
  HangWatchdog(WatchdogOptions opt, TimePoint now);

  /// Records the step counter; a value greater than the last one is progress.
  void progress(uint64_t step, TimePoint now);
  /// Enters a named section (its own limit); nested sections are not supported: the last wins.
  void enter(const std::string& section, TimePoint now);
  /// Leaves the current named section; the stall clock restarts.
  void leave(TimePoint now);
  /// A hang, reported once until progress resumes; nullopt otherwise.
  std::optional<Hang> check(TimePoint now);

  /// The section in force: "startup", "step" or a named one.
  std::string section() const;
  Duration limit() const;
  /// The learned step limit (before override), for metrics.
  Duration learned_step_limit() const;
  uint64_t step() const { return step_; }

 private:
  WatchdogOptions opt_;
  uint64_t step_ = 0;
  int steps_seen_ = 0;
  TimePoint last_progress_;
  std::string named_;
  std::deque<Duration> durations_;
  bool reported_ = false;
};

}  // namespace resilient::detect
