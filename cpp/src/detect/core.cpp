#include "resilient/detect/core.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

#include "resilient/common/config.hpp"

namespace resilient::detect {
namespace {
using std::chrono::milliseconds;

Status env_ms(const char* name, Duration* field) {
  RESILIENT_ASSIGN_OR_RETURN(
      int64_t ms, env_value<int64_t>(name, std::chrono::duration_cast<milliseconds>(*field).count(),
                                     parse_int));
  *field = milliseconds(ms);
  return ok_status();
}

Status env_count(const char* name, int* field) {
  RESILIENT_ASSIGN_OR_RETURN(int64_t v, env_value<int64_t>(name, *field, parse_int));
  if (v < INT32_MIN || v > INT32_MAX) {
    return Status(StatusCode::kInvalidArgument, std::string(name) + " out of range");
  }
  *field = static_cast<int>(v);
  return ok_status();
}

Status invalid(const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "detector options: " + what);
}

}  // namespace

const char* event_kind_name(Event::Kind k) {
  switch (k) {
    case Event::Kind::kSuspect:
      return "suspect";
    case Event::Kind::kUnsuspect:
      return "unsuspect";
    case Event::Kind::kConfirm:
      return "confirm";
    case Event::Kind::kGeneration:
      return "generation";
    case Event::Kind::kEvicted:
      return "evicted";
    case Event::Kind::kHang:
      return "hang";
  }
  return "?";
}

Result<CoreOptions> CoreOptions::from_env(int32_t rank, int32_t world_size) {
  CoreOptions o;
  o.rank = rank;
  o.world_size = world_size;
  RESILIENT_RETURN_IF_ERROR(env_count("RESILIENT_DETECT_WATCH_COUNT", &o.watch_count));
  RESILIENT_RETURN_IF_ERROR(env_ms("RESILIENT_DETECT_HEARTBEAT_MS", &o.heartbeat_interval));
  RESILIENT_ASSIGN_OR_RETURN(
      o.phi_threshold, env_value("RESILIENT_DETECT_PHI_THRESHOLD", o.phi_threshold, parse_double));
  RESILIENT_RETURN_IF_ERROR(
      env_ms("RESILIENT_DETECT_ACCEPTABLE_PAUSE_MS", &o.phi.acceptable_pause));
  RESILIENT_RETURN_IF_ERROR(env_ms("RESILIENT_DETECT_MIN_STDDEV_MS", &o.phi.min_stddev));
  o.phi.first_interval = o.heartbeat_interval;
  RESILIENT_RETURN_IF_ERROR(env_ms("RESILIENT_DETECT_MAX_SILENCE_MS", &o.max_silence));
  o.refused_silence = 3 * o.heartbeat_interval;  // the default follows an overridden heartbeat
  RESILIENT_RETURN_IF_ERROR(env_ms("RESILIENT_DETECT_REFUSED_SILENCE_MS", &o.refused_silence));
  RESILIENT_RETURN_IF_ERROR(env_ms("RESILIENT_DETECT_FRESHNESS_MS", &o.freshness_window));
  RESILIENT_RETURN_IF_ERROR(env_count("RESILIENT_DETECT_GOSSIP_FANOUT", &o.gossip_fanout));
  RESILIENT_RETURN_IF_ERROR(o.validate());
  return o;
}

Status CoreOptions::validate() const {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return invalid("rank " + std::to_string(rank) + " outside a world of " +
                   std::to_string(world_size));
  }
  if (watch_count < 1) return invalid("watch_count (RESILIENT_DETECT_WATCH_COUNT) must be >= 1");
  if (heartbeat_interval <= Duration::zero()) {
    return invalid("heartbeat_interval (RESILIENT_DETECT_HEARTBEAT_MS) must be > 0");
  }
  if (!(phi_threshold > 0)) {
    return invalid("phi_threshold (RESILIENT_DETECT_PHI_THRESHOLD) must be > 0");
  }
  if (max_silence <= Duration::zero()) {
    return invalid("max_silence (RESILIENT_DETECT_MAX_SILENCE_MS) must be > 0");
  }
  if (refused_silence <= Duration::zero()) {
    return invalid("refused_silence (RESILIENT_DETECT_REFUSED_SILENCE_MS) must be > 0");
  }
  if (freshness_window <= Duration::zero()) {
    return invalid("freshness_window (RESILIENT_DETECT_FRESHNESS_MS) must be > 0");
  }
  if (report_ttl <= Duration::zero()) return invalid("report_ttl must be > 0");
  if (gossip_fanout < 0) {
    return invalid("gossip_fanout (RESILIENT_DETECT_GOSSIP_FANOUT) must be >= 0");
  }
  if (store_retry < Duration::zero()) return invalid("store_retry must be >= 0");
  return ok_status();
}

DetectorCore::DetectorCore(CoreOptions opt, GenerationPtr initial, TimePoint now)
    : opt_(std::move(opt)),
      gen_(std::move(initial)),
      replay_(opt_.freshness_window),
      next_ping_(now),
      rng_(opt_.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(opt_.rank)) {
  RESILIENT_CHECK(gen_ != nullptr, "initial generation required");
  evicted_ = !gen_->contains(opt_.rank);
  rewatch(now);
}

std::vector<int32_t> DetectorCore::watchers_of(int32_t peer) const {
  return ring_predecessors(gen_->live, peer, opt_.watch_count);
}

void DetectorCore::rewatch(TimePoint now) {
  watched_ =
      evicted_ ? std::vector<int32_t>{} : ring_successors(gen_->live, opt_.rank, opt_.watch_count);
  std::map<int32_t, Peer> next;
  for (int32_t r : watched_) {
    auto it = peers_.find(r);
    if (it != peers_.end()) {
      next.emplace(r, std::move(it->second));
    } else {
      Peer p{PhiEstimator(opt_.phi)};
      p.est.heartbeat(now);  // silence counts from when we started watching
      next.emplace(r, std::move(p));
    }
  }
  peers_ = std::move(next);
}

void DetectorCore::send(int32_t to, Message msg, TimePoint now) {
  msg.from = opt_.rank;
  msg.to = to;
  msg.generation = gen_->number;
  msg.seq = ++seq_;
  msg.time_ns = now.time_since_epoch().count();
  ++counters_.messages_sent;
  outbox_.push_back({to, std::move(msg)});
}

void DetectorCore::ping(int32_t to, TimePoint now) {
  Message m;
  m.type = MsgType::kPing;
  m.step = step_;
  ++counters_.pings_sent;
  send(to, std::move(m), now);
}

bool DetectorCore::on_message(const Message& m, TimePoint now) {
  if (m.to != opt_.rank || m.from == opt_.rank || m.from < 0 || m.from >= opt_.world_size) {
    ++counters_.dropped_misdirected;
    return false;
  }
  switch (replay_.admit(m.from, m.seq, m.time_ns, now)) {
    case Admission::kAccept:
      break;
    case Admission::kDuplicate:
    case Admission::kOldSeq:
      ++counters_.dropped_replay;
      return false;
    case Admission::kStale:
      ++counters_.dropped_stale;
      return false;
  }
  if (m.type == MsgType::kAck) {
    // Liveness evidence only as the answer to a ping of ours from the last freshness window
    // (the echoed stamp is our own clock, under the sender's MAC).
    Duration age = now.time_since_epoch() - Duration(m.echo_time_ns);
    if (age < Duration::zero() || age > opt_.freshness_window) {
      ++counters_.dropped_stale;
      return false;
    }
  }
  ++counters_.messages_received;
  if (m.generation > gen_->number && m.type != MsgType::kGeneration) {
    request_read(m.generation, now);
  }
  switch (m.type) {
    case MsgType::kPing: {
      Message ack;
      ack.type = MsgType::kAck;
      ack.echo_seq = m.seq;
      ack.echo_time_ns = m.time_ns;
      ack.step = step_;
      send(m.from, std::move(ack), now);
      break;
    }
    case MsgType::kAck: {
      auto it = peers_.find(m.from);
      if (it == peers_.end() || m.echo_seq <= it->second.last_echo) break;  // reordered
      ++counters_.acks_received;
      Peer& p = it->second;
      p.last_echo = m.echo_seq;
      p.refusals = 0;
      p.est.heartbeat(now);
      double rtt =
          std::max(0.0, to_seconds(now.time_since_epoch() - Duration(m.echo_time_ns)) * 1e3);
      p.rtt_ms = p.rtt_ms < 0 ? rtt : 0.8 * p.rtt_ms + 0.2 * rtt;
      if (p.suspected) {
        p.suspected = false;
        ++counters_.unsuspicions;
        events_.push_back({Event::Kind::kUnsuspect, now, m.from, gen_->number, {}, ""});
        tell_watchers(m.from, /*retract=*/true, now);
      }
      break;
    }
    case MsgType::kSuspect:
      on_suspect_message(m, now);
      break;
    case MsgType::kGeneration:
      if (m.generation > gen_->number) request_read(m.generation, now);
      break;
  }
  return true;
}

// The hard-flag rule. A verdict about the sender itself with kFlagHard is the sender announcing
// its own failure: authenticated, fresh, from its own address (the driver checks that), so it
// confirms at once. Any other verdict is one watcher's suspicion of another rank: it counts
// toward the two-watcher quorum only if the sender is one of that rank's watchers, whatever the
// flags say, and kFlagRetract withdraws it.
void DetectorCore::on_suspect_message(const Message& m, TimePoint now) {
  if (!gen_->contains(m.from)) return;
  for (const Verdict& v : m.verdicts) {
    if (!gen_->contains(v.rank) || v.rank == opt_.rank) continue;
    if (v.rank == m.from) {
      if (m.flags & kFlagHard) confirm(v, now);
      continue;
    }
    std::vector<int32_t> w = watchers_of(v.rank);
    if (std::find(w.begin(), w.end(), m.from) == w.end()) {
      ++counters_.ignored_claims;
      continue;
    }
    if (m.flags & kFlagRetract) {
      auto it = reports_.find(v.rank);
      if (it != reports_.end()) it->second.erase(m.from);
    } else {
      reports_[v.rank][m.from] = now;
    }
  }
}

void DetectorCore::on_unreachable(int32_t peer, TimePoint now) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || !gen_->contains(peer)) return;
  ++counters_.refusals;
  if (it->second.refusals++ == 0) it->second.next_probe = now;  // probe again at the next tick
}

void DetectorCore::tell_watchers(int32_t peer, bool retract, TimePoint now) {
  Message m;
  m.type = MsgType::kSuspect;
  m.flags = retract ? kFlagRetract : 0;
  m.verdicts = {Verdict{peer, Reason::kUnresponsive, ""}};
  for (int32_t w : watchers_of(peer)) {
    if (w != opt_.rank) send(w, m, now);
  }
}

void DetectorCore::confirm(Verdict v, TimePoint now) {
  const int32_t peer = v.rank;
  if (confirmed_.count(peer) || !gen_->contains(peer)) return;
  ++counters_.confirmations;
  events_.push_back({Event::Kind::kConfirm, now, peer, gen_->number, {}, reason_name(v.reason)});
  confirmed_[peer] = std::move(v);
  maybe_propose(now);
}

void DetectorCore::report_self(Verdict v, TimePoint now) {
  v.rank = opt_.rank;
  if (confirmed_.count(v.rank) || evicted_) return;
  events_.push_back({Event::Kind::kHang, now, v.rank, gen_->number, {}, v.section});
  confirmed_[v.rank] = v;
  // Announce it too: if this rank cannot reach the store, a watcher proposes the removal.
  Message m;
  m.type = MsgType::kSuspect;
  m.flags = kFlagHard;
  m.verdicts = {v};
  for (int32_t w : watchers_of(opt_.rank)) send(w, m, now);
  maybe_propose(now);
}

void DetectorCore::maybe_propose(TimePoint now) {
  // An evicted rank proposes nothing: the verdicts it still held (a partition's other side,
  // which evicted it first) would remove the very ranks that decided.
  if (evicted_ || confirmed_.empty() || proposing_ != 0 || now < store_retry_at_) return;
  std::vector<Verdict> failed;
  for (const auto& [r, v] : confirmed_) failed.push_back(v);
  StoreRequest req{StoreRequest::Kind::kPropose, gen_->number + 1, gen_->next(failed), gen_};
  proposing_ = req.number;
  ++counters_.proposals;
  store_requests_.push_back(std::move(req));
}

void DetectorCore::request_read(uint64_t number, TimePoint now) {
  if (number <= gen_->number) return;
  if (reading_ >= number && now < read_retry_at_) return;  // already asked
  reading_ = number;
  read_retry_at_ = now + opt_.store_retry;
  store_requests_.push_back({StoreRequest::Kind::kRead, number, Generation{}, gen_});
}

void DetectorCore::on_store_error(const StoreRequest& req, TimePoint now) {
  if (req.kind == StoreRequest::Kind::kRead && catching_up_) {
    catching_up_ = false;  // no newer generation (or no store): caught up as far as it goes
    reading_ = 0;
    return;
  }
  ++counters_.store_errors;
  if (req.kind == StoreRequest::Kind::kPropose && proposing_ == req.number) {
    proposing_ = 0;
    store_retry_at_ = now + opt_.store_retry;
  }
  if (req.kind == StoreRequest::Kind::kRead) read_retry_at_ = now;  // retry on next signal
}

void DetectorCore::on_generation(GenerationPtr g, TimePoint now) {
  if (proposing_ != 0 && g && g->number >= proposing_) proposing_ = 0;
  if (!g || g->number <= gen_->number) return;
  adopt(std::move(g), now);
  if (catching_up_ && !evicted_) request_read(gen_->number + 1, now);  // the next one too
  maybe_propose(now);
}

void DetectorCore::adopt(GenerationPtr g, TimePoint now) {
  GenerationPtr old = std::exchange(gen_, std::move(g));
  ++counters_.generations;
  Event ev{Event::Kind::kGeneration, now, -1, gen_->number, {}, ""};
  std::vector<int32_t> gone;
  std::set_difference(old->live.begin(), old->live.end(), gen_->live.begin(), gen_->live.end(),
                      std::back_inserter(gone));
  for (int32_t r : gone) {
    Verdict v{r, Reason::kUnresponsive, ""};
    for (const Verdict& x : gen_->removed) {
      if (x.rank == r) v = x;
    }
    ev.removed.push_back(v);
    confirmed_.erase(r);
    reports_.erase(r);
  }
  for (auto it = confirmed_.begin(); it != confirmed_.end();) {
    it = gen_->contains(it->first) ? std::next(it) : confirmed_.erase(it);
  }
  events_.push_back(std::move(ev));
  if (!gen_->contains(opt_.rank) && !evicted_) {
    evicted_ = true;
    confirmed_.clear();
    reports_.clear();
    events_.push_back({Event::Kind::kEvicted, now, opt_.rank, gen_->number, {}, ""});
  }
  rewatch(now);
  // Push the decision on: ring successors (guarantees coverage) plus random live ranks (speed).
  Message note;
  note.type = MsgType::kGeneration;
  note.flags = kFlagComplete;
  note.verdicts = gen_->removed;
  std::vector<int32_t> targets = ring_successors(gen_->live, opt_.rank, opt_.watch_count);
  const auto& live = gen_->live;
  for (int i = 0; i < opt_.gossip_fanout && live.size() > targets.size() + 1; ++i) {
    int32_t r = live[std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng_)];
    if (r != opt_.rank && std::find(targets.begin(), targets.end(), r) == targets.end()) {
      targets.push_back(r);
    }
  }
  for (int32_t r : targets) send(r, note, now);
}

void DetectorCore::tick(TimePoint now) {
  if (evicted_) return;
  // Ticks come every few milliseconds: a gap of max_silence means this process did not run
  // (SIGSTOP, a frozen VM). The others may have decided generations meanwhile, this rank's
  // eviction among them, and with the job gone nobody might tell it: it reads them itself.
  if (last_tick_ != TimePoint{} && now - last_tick_ >= opt_.max_silence) {
    catching_up_ = true;
    request_read(gen_->number + 1, now);
  }
  last_tick_ = now;
  if (now >= next_ping_) {
    for (int32_t r : watched_) ping(r, now);
    next_ping_ += opt_.heartbeat_interval;
    if (next_ping_ <= now) next_ping_ = now + opt_.heartbeat_interval;
  }
  for (auto& [r, p] : peers_) {
    if (confirmed_.count(r)) continue;
    // A refusal is a hint, not evidence: probe at 4x the rate until an ack (or the verdict).
    if (p.refusals > 0 && now >= p.next_probe) {
      ping(r, now);
      p.next_probe = now + opt_.heartbeat_interval / 4;
    }
    Duration silence = p.est.silence(now);
    bool suspect = p.est.phi(now) >= opt_.phi_threshold || silence >= opt_.max_silence ||
                   (p.refusals >= 2 && silence >= opt_.refused_silence);
    if (suspect && !p.suspected) {
      p.suspected = true;
      p.suspected_since = now;
      ++counters_.suspicions;
      events_.push_back({Event::Kind::kSuspect, now, r, gen_->number, {}, ""});
    } else if (!suspect && p.suspected) {
      p.suspected = false;
      ++counters_.unsuspicions;
      events_.push_back({Event::Kind::kUnsuspect, now, r, gen_->number, {}, ""});
      tell_watchers(r, /*retract=*/true, now);
    }
    if (!p.suspected) continue;
    std::vector<int32_t> others = watchers_of(r);
    others.erase(std::remove(others.begin(), others.end(), opt_.rank), others.end());
    // Tell the other watchers, again every few intervals in case a report was lost.
    if (now - p.last_suspect_sent >= 5 * opt_.heartbeat_interval) {
      p.last_suspect_sent = now;
      tell_watchers(r, /*retract=*/false, now);
    }
    size_t agree = 0;
    for (const auto& [who, when] : reports_[r]) {
      if (now - when <= opt_.report_ttl && gen_->contains(who)) ++agree;
    }
    // The reason is informational (the quorum is the same): "crash" when the port refused.
    Reason why = p.refusals >= 2 ? Reason::kCrash : Reason::kUnresponsive;
    if (others.empty() || agree >= 1 || seconded_by_none(r, others, now)) {
      confirm(Verdict{r, why, ""}, now);
    }
  }
  maybe_propose(now);
}

// The other watchers of `peer` cannot second a suspicion when they are gone too (several ranks
// lost at once: with 3 ranks, each dead rank's second watcher is the other dead one). A
// watcher then confirms alone, once it has suspected `peer` and heard from none of those
// watchers (each suspected by it, or confirmed) for max_silence beyond the suspicion. A watcher
// that is itself cut off (a partition) sees the same from its side; but its own watchers
// evict it within the suspicion time while it waits max_silence longer, and its late proposal
// then returns their decided generation (it is evicted, not them).
bool DetectorCore::seconded_by_none(int32_t peer, const std::vector<int32_t>& others,
                                    TimePoint now) const {
  auto silent_since = [&](int32_t r, TimePoint* since) {
    auto it = peers_.find(r);
    if (it == peers_.end() || !it->second.suspected) return false;
    *since = it->second.suspected_since;
    return true;
  };
  TimePoint since{};
  if (!silent_since(peer, &since) || now - since < opt_.max_silence) return false;
  for (int32_t w : others) {
    if (confirmed_.count(w)) continue;
    if (!silent_since(w, &since) || now - since < opt_.max_silence) return false;
  }
  return true;
}

std::vector<PeerStats> DetectorCore::peer_stats(TimePoint now) const {
  std::vector<PeerStats> out;
  for (const auto& [r, p] : peers_) {
    out.push_back({r, p.est.phi(now), p.rtt_ms, p.est.mean_ms(), p.suspected});
  }
  return out;
}

}  // namespace resilient::detect
