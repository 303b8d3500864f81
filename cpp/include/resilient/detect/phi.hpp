#pragma once
// Phi-accrual suspicion (Hayashibara et al.): from a window of observed heartbeat inter-arrival
// times, phi(t) = -log10(P(next arrival later than t)), modelled as a normal distribution whose
// mean is shifted by an acceptable pause and whose deviation has a floor (as Akka does), so a
// quiet, regular link does not turn a single late packet into a suspicion.

#include <cstddef>
#include <vector>

#include "resilient/common/clock.hpp"

namespace resilient::detect {

struct PhiOptions {
  size_t window = 100;  ///< inter-arrival samples kept
  Duration min_stddev = std::chrono::milliseconds(100);
  Duration acceptable_pause = std::chrono::milliseconds(1000);
  Duration first_interval = std::chrono::milliseconds(100);  ///< prior before any sample
};

/// Inter-arrival history of one peer. Thread-compatible (owned by one state machine).
class PhiEstimator {
 public:
  explicit PhiEstimator(PhiOptions opt = {});

  /// Records a heartbeat arrival at `now`.
  void heartbeat(TimePoint now);
  /// Suspicion level at `now`: 0 when just heard from, grows with silence; capped at 1e3.
  double phi(TimePoint now) const;
  /// Time since the last arrival (or since the first, prior-only, arrival).
  Duration silence(TimePoint now) const { return now - last_; }
  bool has_arrival() const { return started_; }
  double mean_ms() const;
  double stddev_ms() const;
  size_t samples() const { return count_; }

 private:
  PhiOptions opt_;
  std::vector<double> ring_;  // inter-arrival seconds
  size_t next_ = 0, count_ = 0;
  double sum_ = 0, sum_sq_ = 0;
  TimePoint last_{};
  bool started_ = false;
};

}  // namespace resilient::detect
