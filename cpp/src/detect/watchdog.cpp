#include "resilient/detect/watchdog.hpp"

#include <algorithm>

#include "resilient/common/config.hpp"

namespace resilient::detect {
namespace {

Status env_seconds(const char* name, Duration* field) {
  RESILIENT_ASSIGN_OR_RETURN(double s, env_value(name, to_seconds(*field), parse_double));
  *field = from_seconds(s);
  return ok_status();
}

Status invalid(const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "watchdog options: " + what);
}

}  // namespace

Result<WatchdogOptions> WatchdogOptions::from_env() {
  WatchdogOptions o;
  RESILIENT_ASSIGN_OR_RETURN(o.safety_factor, env_value("RESILIENT_DETECT_HANG_SAFETY_FACTOR",
                                                        o.safety_factor, parse_double));
  RESILIENT_RETURN_IF_ERROR(env_seconds("RESILIENT_DETECT_HANG_MIN_STEP_S", &o.min_step_limit));
  RESILIENT_RETURN_IF_ERROR(env_seconds("RESILIENT_DETECT_HANG_STEP_S", &o.step_limit_override));
  RESILIENT_RETURN_IF_ERROR(env_seconds("RESILIENT_DETECT_HANG_STARTUP_S", &o.startup_limit));
  RESILIENT_RETURN_IF_ERROR(
      env_seconds("RESILIENT_DETECT_HANG_CHECKPOINT_S", &o.section_limits["checkpoint"]));
  RESILIENT_RETURN_IF_ERROR(o.validate());
  return o;
}

Status WatchdogOptions::validate() const {
  if (!(safety_factor >= 1.0)) {
    return invalid("safety_factor (RESILIENT_DETECT_HANG_SAFETY_FACTOR) must be >= 1");
  }
  if (min_step_limit < Duration::zero())
    return invalid("min_step_limit (RESILIENT_DETECT_HANG_MIN_STEP_S) must be >= 0");
  if (step_limit_override < Duration::zero())
    return invalid("step_limit_override (RESILIENT_DETECT_HANG_STEP_S) must be >= 0");
  if (startup_limit < Duration::zero())
    return invalid("startup_limit (RESILIENT_DETECT_HANG_STARTUP_S) must be >= 0");
  for (const auto& [name, limit] : section_limits) {
    if (limit < Duration::zero()) {
      return invalid("limit of section '" + name + "'" +
                     (name == "checkpoint" ? " (RESILIENT_DETECT_HANG_CHECKPOINT_S)" : "") +
                     " must be >= 0");
    }
  }
  if (warmup_steps < 0) return invalid("warmup_steps must be >= 0");
  if (window < 1) return invalid("window must be >= 1");
  return ok_status();
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
