#include "resilient/straggler/options.hpp"

#include <cmath>
#include <string>

#include "resilient/common/config.hpp"

namespace resilient::straggler {
namespace {

Status invalid(const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "straggler options: " + what);
}

}  // namespace

StragglerOptions StragglerOptions::from_env() {
  StragglerOptions o;
  o.interval = env_int("RESILIENT_STRAGGLER_INTERVAL", o.interval);
  o.slow_ratio = env_double("RESILIENT_STRAGGLER_SLOW_RATIO", o.slow_ratio);
  o.z_threshold = env_double("RESILIENT_STRAGGLER_Z_THRESHOLD", o.z_threshold);
  o.min_ratio = env_double("RESILIENT_STRAGGLER_MIN_RATIO", o.min_ratio);
  o.mad_floor = env_double("RESILIENT_STRAGGLER_MAD_FLOOR", o.mad_floor);
  o.min_step_fraction = env_double("RESILIENT_STRAGGLER_MIN_STEP_FRACTION", o.min_step_fraction);
  o.min_ranks = env_int("RESILIENT_STRAGGLER_MIN_RANKS", o.min_ranks);
  o.history_windows = env_int("RESILIENT_STRAGGLER_HISTORY", o.history_windows);
  o.report_after = env_int("RESILIENT_STRAGGLER_REPORT_AFTER", o.report_after);
  o.cusum.drift = env_double("RESILIENT_STRAGGLER_CUSUM_DRIFT", o.cusum.drift);
  o.cusum.threshold = env_double("RESILIENT_STRAGGLER_CUSUM_THRESHOLD", o.cusum.threshold);
  o.cusum.clip = env_double("RESILIENT_STRAGGLER_CUSUM_CLIP", o.cusum.clip);
  o.cusum.cap = env_double("RESILIENT_STRAGGLER_CUSUM_CAP", o.cusum.cap);
  return o;
}

Status StragglerOptions::validate() const {
  if (interval < 1) return invalid("interval must be >= 1");
  if (!(min_ratio > 1.0)) return invalid("min_ratio must be > 1");
  if (!(slow_ratio >= min_ratio)) return invalid("slow_ratio must be >= min_ratio");
  if (!(z_threshold > 0.0)) return invalid("z_threshold must be > 0");
  if (!(mad_floor >= 0.0) || !std::isfinite(mad_floor)) return invalid("mad_floor must be >= 0");
  if (!(min_step_fraction >= 0.0) || !(min_step_fraction < 1.0)) {
    return invalid("min_step_fraction must be in [0, 1)");
  }
  if (min_ranks < 2) return invalid("min_ranks must be >= 2");
  if (history_windows < 1) return invalid("history_windows must be >= 1");
  if (report_after < 1) return invalid("report_after must be >= 1");
  if (!(cusum.drift > 0.0)) return invalid("cusum drift must be > 0");
  if (!(cusum.threshold > 0.0)) return invalid("cusum threshold must be > 0");
  if (!(cusum.clip > cusum.drift)) return invalid("cusum clip must be > drift");
  if (!(cusum.cap >= cusum.threshold)) return invalid("cusum cap must be >= threshold");
  return ok_status();
}

}  // namespace resilient::straggler
