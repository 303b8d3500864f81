#include "resilient/detect/freshness.hpp"

#include <algorithm>

namespace resilient::detect {

const char* admission_name(Admission a) {
  switch (a) {
    case Admission::kAccept:
      return "accept";
    case Admission::kDuplicate:
      return "duplicate";
    case Admission::kOldSeq:
      return "old_seq";
    case Admission::kStale:
      return "stale";
  }
  return "?";
}

ReplayGuard::ReplayGuard(Duration window, double max_drift)
    : window_(window), max_drift_(max_drift) {}

Admission ReplayGuard::admit(int32_t sender, uint64_t seq, int64_t sent_ns, TimePoint now) {
  if (seq == 0) return Admission::kOldSeq;  // senders number from 1
  auto [it, first] = senders_.try_emplace(sender);
  Sender& s = it->second;
  if (!first) {
    if (seq <= s.top) {
      uint64_t back = s.top - seq;
      if (back >= 64) return Admission::kOldSeq;
      if (s.seen & (uint64_t{1} << back)) return Admission::kDuplicate;
    }
  }
  const int64_t now_ns = now.time_since_epoch().count();
  const int64_t delay = now_ns - sent_ns;  // one-way delay + clock offset
  int64_t allowed = delay;
  if (!first) {
    double since = std::max(0.0, to_seconds(now - s.offset_at));
    allowed = s.offset_ns + static_cast<int64_t>(since * max_drift_ * 1e9);
    if (delay - allowed > window_.count()) return Admission::kStale;
  }
  s.offset_ns = std::min(delay, allowed);
  s.offset_at = now;
  if (first) {
    s.top = seq;
    s.seen = 1;
  } else if (seq > s.top) {
    uint64_t shift = seq - s.top;
    s.seen = shift >= 64 ? 1 : (s.seen << shift) | 1;
    s.top = seq;
  } else {
    s.seen |= uint64_t{1} << (s.top - seq);
  }
  return Admission::kAccept;
}

}  // namespace resilient::detect
