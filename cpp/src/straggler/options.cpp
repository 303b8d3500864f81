#include "resilient/straggler/options.hpp"

#include <cmath>
#include <string>
#include <utility>

#include "resilient/common/config.hpp"

namespace resilient::straggler {
namespace {

Status invalid(const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "straggler options: " + what);
}

}  // namespace

Result<StragglerOptions> StragglerOptions::from_env() {
  StragglerOptions o;
  for (auto [name, field] : {std::pair{"RESILIENT_STRAGGLER_INTERVAL", &o.interval},
                             std::pair{"RESILIENT_STRAGGLER_MIN_RANKS", &o.min_ranks},
                             std::pair{"RESILIENT_STRAGGLER_HISTORY", &o.history_windows},
                             std::pair{"RESILIENT_STRAGGLER_REPORT_AFTER", &o.report_after}}) {
    RESILIENT_ASSIGN_OR_RETURN(*field, env_value(name, *field, parse_int));
  }
  for (auto [name, field] :
       {std::pair{"RESILIENT_STRAGGLER_SLOW_RATIO", &o.slow_ratio},
        std::pair{"RESILIENT_STRAGGLER_Z_THRESHOLD", &o.z_threshold},
        std::pair{"RESILIENT_STRAGGLER_MIN_RATIO", &o.min_ratio},
        std::pair{"RESILIENT_STRAGGLER_MAD_FLOOR", &o.mad_floor},
        std::pair{"RESILIENT_STRAGGLER_MIN_STEP_FRACTION", &o.min_step_fraction},
        std::pair{"RESILIENT_STRAGGLER_CUSUM_DRIFT", &o.cusum.drift},
        std::pair{"RESILIENT_STRAGGLER_CUSUM_THRESHOLD", &o.cusum.threshold},
        std::pair{"RESILIENT_STRAGGLER_CUSUM_CLIP", &o.cusum.clip},
        std::pair{"RESILIENT_STRAGGLER_CUSUM_CAP", &o.cusum.cap}}) {
    RESILIENT_ASSIGN_OR_RETURN(*field, env_value(name, *field, parse_double));
  }
  return o;
}

Status StragglerOptions::validate() const {
  if (interval < 1) return invalid("interval (RESILIENT_STRAGGLER_INTERVAL) must be >= 1");
  if (!(min_ratio > 1.0)) return invalid("min_ratio (RESILIENT_STRAGGLER_MIN_RATIO) must be > 1");
  if (!(slow_ratio >= min_ratio))
    return invalid(
        "slow_ratio (RESILIENT_STRAGGLER_SLOW_RATIO) must be >= min_ratio "
        "(RESILIENT_STRAGGLER_MIN_RATIO)");
  if (!(z_threshold > 0.0))
    return invalid("z_threshold (RESILIENT_STRAGGLER_Z_THRESHOLD) must be > 0");
  if (!(mad_floor >= 0.0) || !std::isfinite(mad_floor))
    return invalid("mad_floor (RESILIENT_STRAGGLER_MAD_FLOOR) must be >= 0");
  if (!(min_step_fraction >= 0.0) || !(min_step_fraction < 1.0)) {
    return invalid("min_step_fraction (RESILIENT_STRAGGLER_MIN_STEP_FRACTION) must be in [0, 1)");
  }
  if (min_ranks < 2) return invalid("min_ranks (RESILIENT_STRAGGLER_MIN_RANKS) must be >= 2");
  if (history_windows < 1)
    return invalid("history_windows (RESILIENT_STRAGGLER_HISTORY) must be >= 1");
  if (report_after < 1)
    return invalid("report_after (RESILIENT_STRAGGLER_REPORT_AFTER) must be >= 1");
  if (!(cusum.drift > 0.0))
    return invalid("cusum drift (RESILIENT_STRAGGLER_CUSUM_DRIFT) must be > 0");
  if (!(cusum.threshold > 0.0))
    return invalid("cusum threshold (RESILIENT_STRAGGLER_CUSUM_THRESHOLD) must be > 0");
  if (!(cusum.clip > cusum.drift))
    return invalid(
        "cusum clip (RESILIENT_STRAGGLER_CUSUM_CLIP) must be > drift "
        "(RESILIENT_STRAGGLER_CUSUM_DRIFT)");
  if (!(cusum.cap >= cusum.threshold))
    return invalid(
        "cusum cap (RESILIENT_STRAGGLER_CUSUM_CAP) must be >= threshold "
        "(RESILIENT_STRAGGLER_CUSUM_THRESHOLD)");
  return ok_status();
}

}  // namespace resilient::straggler
