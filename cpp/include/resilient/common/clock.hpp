#pragma once
// Injectable clocks: decisions take `now` from a Clock so timeout logic is tested without sleeping.

#include <atomic>
#include <chrono>
#include <cstdint>

namespace resilient {

using Duration = std::chrono::nanoseconds;
using TimePoint = std::chrono::time_point<std::chrono::steady_clock, Duration>;

/// A source of monotonic time. Implementations are thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimePoint now() const = 0;
};

/// std::chrono::steady_clock.
class SteadyClock final : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now(); }
  /// A process-wide instance.
  static const SteadyClock& instance();
};

/// A clock that moves only when told to; for deterministic tests.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(TimePoint start = TimePoint{}) : ns_(start.time_since_epoch().count()) {}
  TimePoint now() const override { return TimePoint{Duration{ns_.load()}}; }
  void advance(Duration d) { ns_ += d.count(); }
  void set(TimePoint t) { ns_ = t.time_since_epoch().count(); }

 private:
  std::atomic<int64_t> ns_;
};

/// Seconds as a double, for reports.
inline double to_seconds(Duration d) { return std::chrono::duration<double>(d).count(); }
inline Duration from_seconds(double s) {
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

}  // namespace resilient
