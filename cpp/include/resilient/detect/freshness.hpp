#pragma once
// Replay protection for authenticated detector datagrams, as a pure function of (now, state).
//
// Cross-run replays never get here: the MAC key and the header are scoped to one run (wire.hpp).
// Within a run, every sender numbers its messages 1, 2, 3, ... and stamps them with its own
// monotonic clock. For each sender the guard keeps the highest sequence number seen and a 64-bit
// window below it (as IPsec's anti-replay window does): a number seen before is a duplicate, one
// older than the window is stale. Clocks of different hosts are not synchronised, so freshness in
// time is judged against a learned offset: the smallest (receiver now - sender stamp) seen so far
// is the one-way delay plus the clocks' offset; a datagram whose delay exceeds it by more than
// `window` was held back (captured and replayed later) and is dropped. The offset may rise by at
// most `max_drift` seconds per second (clock rate differences), so a replay cannot drag it up.

#include <cstdint>
#include <unordered_map>

#include "resilient/common/clock.hpp"

namespace resilient::detect {

/// Verdict of ReplayGuard::admit.
enum class Admission {
  kAccept,
  kDuplicate,  ///< this sequence number was accepted before
  kOldSeq,     ///< older than the 64-message window below the newest one
  kStale,      ///< outside the freshness window (held back and replayed)
};
const char* admission_name(Admission a);

/// Per-sender replay state. Thread-compatible (owned by one state machine).
class ReplayGuard {
 public:
  /// `window`: largest extra delay accepted; `max_drift`: clock rate difference tolerated.
  explicit ReplayGuard(Duration window = std::chrono::seconds(5), double max_drift = 1e-3);

  /// Judges a datagram from `sender` numbered `seq` (>= 1), stamped `sent_ns` on the sender's
  /// clock, arriving at `now`; an accepted one updates the state.
  Admission admit(int32_t sender, uint64_t seq, int64_t sent_ns, TimePoint now);

  Duration window() const { return window_; }

 private:
  struct Sender {
    uint64_t top = 0;   // highest accepted seq
    uint64_t seen = 0;  // bit i: top - i was accepted
    int64_t offset_ns = 0;
    TimePoint offset_at{};
  };
  Duration window_;
  double max_drift_;
  std::unordered_map<int32_t, Sender> senders_;
};

}  // namespace resilient::detect
