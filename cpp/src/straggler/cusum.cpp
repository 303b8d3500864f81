#include "resilient/straggler/cusum.hpp"

#include <algorithm>
#include <cmath>

namespace resilient::straggler {

CusumEvent cusum_update(CusumState& state, double evidence, int64_t window_first_step,
                        const CusumParams& params) {
  CusumEvent event;
  const double x = std::isfinite(evidence) ? std::clamp(evidence, 0.0, params.clip) : 0.0;
  const double next = std::min(params.cap, std::max(0.0, state.sum + x - params.drift));
  if (state.sum <= 0.0 && next > 0.0) {
    state.run_start = window_first_step;
    state.flagged_windows = 0;
    state.persistent = false;
  }
  if (x > 0.0) ++state.flagged_windows;
  state.sum = next;
  if (!state.persistent && state.sum >= params.threshold) {
    state.persistent = true;
    event.became_persistent = true;
  }
  if (state.sum <= 0.0) {
    event.recovered = state.persistent;
    state = CusumState{};
  }
  return event;
}

}  // namespace resilient::straggler
