#include "resilient/detect/phi.hpp"

#include <algorithm>
#include <cmath>

namespace resilient::detect {

PhiEstimator::PhiEstimator(PhiOptions opt) : opt_(opt), ring_(std::max<size_t>(opt.window, 1)) {
  // Seed with a prior so phi is meaningful from the first heartbeat on.
  double prior = to_seconds(opt_.first_interval);
  ring_[0] = prior;
  next_ = 1 % ring_.size();
  count_ = 1;
  sum_ = prior;
  sum_sq_ = prior * prior;
}

void PhiEstimator::heartbeat(TimePoint now) {
  if (started_) {
    double dt = to_seconds(now - last_);
    if (dt < 0) dt = 0;
    if (count_ == ring_.size()) {
      double old = ring_[next_];
      sum_ -= old;
      sum_sq_ -= old * old;
    } else {
      ++count_;
    }
    ring_[next_] = dt;
    next_ = (next_ + 1) % ring_.size();
    sum_ += dt;
    sum_sq_ += dt * dt;
  }
  started_ = true;
  last_ = now;
}

double PhiEstimator::mean_ms() const { return 1e3 * sum_ / static_cast<double>(count_); }

double PhiEstimator::stddev_ms() const {
  double mean = sum_ / static_cast<double>(count_);
  double var = std::max(0.0, sum_sq_ / static_cast<double>(count_) - mean * mean);
  return 1e3 * std::max(std::sqrt(var), to_seconds(opt_.min_stddev));
}

double PhiEstimator::phi(TimePoint now) const {
  if (!started_) return 0;
  double elapsed = to_seconds(now - last_);
  double mean = mean_ms() / 1e3 + to_seconds(opt_.acceptable_pause);
  double sd = stddev_ms() / 1e3;
  // Logistic approximation of the normal CDF tail (as used by Akka / Cassandra); stable for
  // large y where 1 - cdf underflows.
  double y = (elapsed - mean) / sd;
  double e = std::exp(-y * (1.5976 + 0.070566 * y * y));
  double p_later = elapsed > mean ? e / (1.0 + e) : 1.0 - 1.0 / (1.0 + e);
  if (p_later <= 0) return 1e3;
  return std::min(1e3, -std::log10(p_later));
}

}  // namespace resilient::detect
