#include "resilient/straggler/stats.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "resilient/common/status.hpp"

namespace resilient::straggler {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::vector<double> finite_copy(std::span<const double> values) {
  std::vector<double> out;
  out.reserve(values.size());
  for (double v : values) {
    if (std::isfinite(v)) out.push_back(v);
  }
  return out;
}

// Median of `v` (reordered in place); NaN when empty.
double median_inplace(std::vector<double>& v) {
  if (v.empty()) return kNaN;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  const double lower = *std::max_element(v.begin(), v.begin() + mid);
  return lower + (upper - lower) / 2;
}

}  // namespace

double median(std::span<const double> values) {
  std::vector<double> v = finite_copy(values);
  return median_inplace(v);
}

double mad(std::span<const double> values, double center) {
  if (!std::isfinite(center)) return kNaN;
  std::vector<double> v = finite_copy(values);
  for (double& x : v) x = std::fabs(x - center);
  return median_inplace(v);
}

RobustSummary summarize(std::span<const double> values) {
  std::vector<double> v = finite_copy(values);
  RobustSummary s{kNaN, kNaN, v.size()};
  if (v.empty()) return s;
  s.median = median_inplace(v);
  for (double& x : v) x = std::fabs(x - s.median);
  s.mad = median_inplace(v);
  return s;
}

double robust_scale(const RobustSummary& s, double floor_fraction) {
  double scale = 1e-12;
  if (std::isfinite(s.mad)) scale = std::max(scale, kMadToSigma * s.mad);
  if (std::isfinite(s.median)) scale = std::max(scale, floor_fraction * std::fabs(s.median));
  return scale;
}

double robust_z(double x, const RobustSummary& s, double scale) {
  if (!std::isfinite(x) || !std::isfinite(s.median) || !(scale > 0)) return 0.0;
  return (x - s.median) / scale;
}

RollingHistory::RollingHistory(size_t capacity) : buffer_(capacity) {
  RESILIENT_CHECK(capacity > 0, "RollingHistory capacity must be positive");
}

void RollingHistory::push(double value) {
  if (!std::isfinite(value)) return;
  buffer_[head_] = value;
  head_ = (head_ + 1) % buffer_.size();
  size_ = std::min(size_ + 1, buffer_.size());
}

std::vector<double> RollingHistory::values() const {
  std::vector<double> out;
  out.reserve(size_);
  const size_t start = (head_ + buffer_.size() - size_) % buffer_.size();
  for (size_t i = 0; i < size_; ++i) out.push_back(buffer_[(start + i) % buffer_.size()]);
  return out;
}

double RollingHistory::median() const {
  std::vector<double> v = values();
  return median_inplace(v);
}

}  // namespace resilient::straggler
