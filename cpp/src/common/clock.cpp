#include "resilient/common/clock.hpp"

namespace resilient {

const SteadyClock& SteadyClock::instance() {
  static const SteadyClock clock;
  return clock;
}

}  // namespace resilient
