#pragma once
// Robust statistics for straggler scoring: median, median absolute deviation (MAD) and a
// MAD-based z-score, plus a fixed-capacity rolling history. All functions are pure.

#include <cstddef>
#include <span>
#include <vector>

namespace resilient::straggler {

/// 1.4826 * MAD estimates the standard deviation of normally distributed data.
inline constexpr double kMadToSigma = 1.4826;

/// Median and MAD of the finite values of a sample.
struct RobustSummary {
  double median;  ///< NaN when `count` is 0.
  double mad;     ///< Median absolute deviation from `median`; NaN when `count` is 0.
  size_t count;   ///< Number of finite values used (NaN and infinities are skipped).
};

/// Median of the finite values in `values` (the mean of the two middle values for an even count).
/// @returns NaN when there is no finite value. Thread-safe (pure).
double median(std::span<const double> values);

/// Median absolute deviation of the finite values around `center`.
/// @returns NaN when there is no finite value or `center` is not finite. Thread-safe (pure).
double mad(std::span<const double> values, double center);

/// Median and MAD in one pass over a copy of the finite values. Thread-safe (pure).
RobustSummary summarize(std::span<const double> values);

/// Robust spread used as the z-score denominator: max(1.4826 * mad, floor_fraction * |median|,
/// 1e-12). The floor keeps tiny but legitimate jitter from producing huge z-scores when most
/// ranks report identical times. Thread-safe (pure).
double robust_scale(const RobustSummary& s, double floor_fraction);

/// (x - median) / scale; 0 when x or the summary is not finite. Thread-safe (pure).
double robust_z(double x, const RobustSummary& s, double scale);

/// The last `capacity` values pushed, oldest dropped first. Thread-compatible.
class RollingHistory {
 public:
  /// @param capacity maximum number of values kept; must be > 0 (RESILIENT_CHECK).
  explicit RollingHistory(size_t capacity);

  /// Appends a value; non-finite values are ignored.
  void push(double value);
  /// Values currently held, oldest first.
  std::vector<double> values() const;
  size_t size() const { return size_; }
  size_t capacity() const { return buffer_.size(); }
  /// Median of the held values, NaN when empty.
  double median() const;
  void clear() {
    size_ = 0;
    head_ = 0;
  }

 private:
  std::vector<double> buffer_;
  size_t head_ = 0;  // index of the next write
  size_t size_ = 0;
};

}  // namespace resilient::straggler
