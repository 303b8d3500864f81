#include "resilient/detect/watchdog.hpp"

#include <algorithm>

#include "resilient/common/config.hpp"

namespace resilient::detect {
namespace {
Duration env_s(const char* name, Duration fallback) {
  return from_seconds(env_double(name, to_seconds(fallback)));
}
}  // namespace

WatchdogOptions WatchdogOptions::from_env() {
  WatchdogOptions o;
  o.safety_factor = env_double("RESILIENT_DETECT_HANG_SAFETY_FACTOR", o.safety_factor);
  o.min_step_limit = env_s("RESILIENT_DETECT_HANG_MIN_STEP_S", o.min_step_limit);
  o.step_limit_override = env_s("RESILIENT_DETECT_HANG_STEP_S", o.step_limit_override);
  o.startup_limit = env_s("RESILIENT_DETECT_HANG_STARTUP_S", o.startup_limit);
  o.section_limits["checkpoint"] =
      env_s("RESILIENT_DETECT_HANG_CHECKPOINT_S", o.section_limits["checkpoint"]);
  if (o.safety_factor < 1.0) throw std::invalid_argument("RESILIENT_DETECT_HANG_SAFETY_FACTOR < 1");
  return o;
}

HangWatchdog::HangWatchdog(WatchdogOptions opt, TimePoint now)
    : opt_(std::move(opt)), last_progress_(now) {}

void HangWatchdog::progress(uint64_t step, TimePoint now) {
  if (step <= step_) return;
  // A stall already reported as a hang is not a step time to learn from.
  if (steps_seen_ > 0 && named_.empty() && !reported_) {
    Duration per_step = (now - last_progress_) / static_cast<int64_t>(step - step_);
    durations_.push_back(per_step);
    if (durations_.size() > opt_.window) durations_.pop_front();
  }
  ++steps_seen_;
  step_ = step;
  last_progress_ = now;
  reported_ = false;
}

void HangWatchdog::enter(const std::string& section, TimePoint now) {
  named_ = section;
  last_progress_ = now;
  reported_ = false;
}

void HangWatchdog::leave(TimePoint now) {
  named_.clear();
  last_progress_ = now;
  reported_ = false;
}

std::string HangWatchdog::section() const {
  if (!named_.empty()) return named_;
  return steps_seen_ < opt_.warmup_steps ? "startup" : "step";
}

Duration HangWatchdog::learned_step_limit() const {
  Duration worst = Duration::zero();
  for (Duration d : durations_) worst = std::max(worst, d);
  auto learned = std::chrono::duration_cast<Duration>(worst * opt_.safety_factor);
  return std::max(learned, opt_.min_step_limit);
}

Duration HangWatchdog::limit() const {
  if (!named_.empty()) {
    auto it = opt_.section_limits.find(named_);
    if (it != opt_.section_limits.end()) return it->second;
  } else if (steps_seen_ < opt_.warmup_steps) {
    return opt_.startup_limit;
  }
  if (opt_.step_limit_override > Duration::zero()) return opt_.step_limit_override;
  return learned_step_limit();
}

std::optional<Hang> HangWatchdog::check(TimePoint now) {
  Duration stalled = now - last_progress_;
  Duration lim = limit();
  if (reported_ || stalled <= lim) return std::nullopt;
  reported_ = true;
  return Hang{section(), stalled, lim};
}

}  // namespace resilient::detect
