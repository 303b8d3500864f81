#include "resilient/detect/core.hpp"

#include <algorithm>

#include "resilient/common/config.hpp"

namespace resilient::detect {
namespace {
using std::chrono::milliseconds;

Duration env_ms(const char* name, Duration fallback) {
  return milliseconds(env_int(name, std::chrono::duration_cast<milliseconds>(fallback).count()));
}
}  // namespace

const char* event_kind_name(Event::Kind k) {
  switch (k) {
    case Event::Kind::kSuspect: return "suspect";
    case Event::Kind::kUnsuspect: return "unsuspect";
    case Event::Kind::kConfirm: return "confirm";
    case Event::Kind::kGeneration: return "generation";
    case Event::Kind::kEvicted: return "evicted";
    case Event::Kind::kHang: return "hang";
  }
  return "?";
}

CoreOptions CoreOptions::from_env(int32_t rank, int32_t world_size) {
  CoreOptions o;
  o.rank = rank;
  o.world_size = world_size;
  o.watch_count = static_cast<int>(env_int("RESILIENT_DETECT_WATCH_COUNT", o.watch_count));
  o.heartbeat_interval = env_ms("RESILIENT_DETECT_HEARTBEAT_MS", o.heartbeat_interval);
  o.phi_threshold = env_double("RESILIENT_DETECT_PHI_THRESHOLD", o.phi_threshold);
  o.phi.acceptable_pause = env_ms("RESILIENT_DETECT_ACCEPTABLE_PAUSE_MS", o.phi.acceptable_pause);
  o.phi.min_stddev = env_ms("RESILIENT_DETECT_MIN_STDDEV_MS", o.phi.min_stddev);
  o.phi.first_interval = o.heartbeat_interval;
  o.max_silence = env_ms("RESILIENT_DETECT_MAX_SILENCE_MS", o.max_silence);
  o.gossip_fanout = static_cast<int>(env_int("RESILIENT_DETECT_GOSSIP_FANOUT", o.gossip_fanout));
  if (o.watch_count < 1 || o.heartbeat_interval <= Duration::zero() || o.gossip_fanout < 0) {
    throw std::invalid_argument("RESILIENT_DETECT_*: watch count >= 1, heartbeat > 0, fanout >= 0");
  }
  return o;
}

DetectorCore::DetectorCore(CoreOptions opt, GenerationPtr initial, TimePoint now)
    : opt_(std::move(opt)), gen_(std::move(initial)), next_ping_(now),
      rng_(opt_.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(opt_.rank)) {
  RESILIENT_CHECK(gen_ != nullptr, "initial generation required");
  evicted_ = !gen_->contains(opt_.rank);
  rewatch(now);
}

std::vector<int32_t> DetectorCore::watchers_of(int32_t peer) const {
  return ring_predecessors(gen_->live, peer, opt_.watch_count);
}

void DetectorCore::rewatch(TimePoint now) {
  watched_ = evicted_ ? std::vector<int32_t>{} : ring_successors(gen_->live, opt_.rank, opt_.watch_count);
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

void DetectorCore::send(int32_t to, Message msg) {
  msg.from = opt_.rank;
  msg.generation = gen_->number;
  ++counters_.messages_sent;
  outbox_.push_back({to, std::move(msg)});
}

void DetectorCore::on_message(const Message& m, TimePoint now) {
  ++counters_.messages_received;
  if (m.generation > gen_->number && m.type != MsgType::kGeneration) {
    request_read(m.generation, {}, false, now);
  }
  switch (m.type) {
    case MsgType::kPing: {
      Message ack;
      ack.type = MsgType::kAck;
      ack.seq = m.seq;
      ack.time_ns = m.time_ns;
      ack.step = step_;
      send(m.from, std::move(ack));
      break;
    }
    case MsgType::kAck: {
      auto it = peers_.find(m.from);
      if (it == peers_.end() || m.seq <= it->second.last_seq) break;  // stale or duplicate
      ++counters_.acks_received;
      Peer& p = it->second;
      p.last_seq = m.seq;
      p.est.heartbeat(now);
      double rtt = std::max(0.0, to_seconds(now.time_since_epoch() - Duration(m.time_ns)) * 1e3);
      p.rtt_ms = p.rtt_ms < 0 ? rtt : 0.8 * p.rtt_ms + 0.2 * rtt;
      if (p.suspected) {
        p.suspected = false;
        ++counters_.unsuspicions;
        events_.push_back({Event::Kind::kUnsuspect, now, m.from, gen_->number, {}, ""});
      }
      break;
    }
    case MsgType::kSuspect:
      if (!gen_->contains(m.from)) break;
      for (const Verdict& v : m.verdicts) {
        if (!gen_->contains(v.rank) || v.rank == opt_.rank) continue;
        if (m.flags & kFlagHard) {
          confirm(v.rank, v.reason, now);
        } else {
          reports_[v.rank][m.from] = now;
        }
      }
      break;
    case MsgType::kGeneration:
      if (m.generation > gen_->number) {
        request_read(m.generation, m.verdicts, (m.flags & kFlagComplete) != 0, now);
      }
      break;
  }
}

void DetectorCore::on_unreachable(int32_t peer, TimePoint now) {
  if (peers_.count(peer) && gen_->contains(peer)) confirm(peer, Reason::kCrash, now);
}

void DetectorCore::confirm(int32_t peer, Reason reason, TimePoint now) {
  if (confirmed_.count(peer) || !gen_->contains(peer)) return;
  ++counters_.confirmations;
  confirmed_[peer] = Verdict{peer, reason, ""};
  events_.push_back({Event::Kind::kConfirm, now, peer, gen_->number, {}, reason_name(reason)});
  maybe_propose(now);
}

void DetectorCore::report_self(Verdict v, TimePoint now) {
  v.rank = opt_.rank;
  if (confirmed_.count(v.rank) || evicted_) return;
  events_.push_back({Event::Kind::kHang, now, v.rank, gen_->number, {}, v.section});
  confirmed_[v.rank] = v;
  maybe_propose(now);
}

void DetectorCore::maybe_propose(TimePoint now) {
  if (confirmed_.empty() || proposing_ != 0 || now < store_retry_at_) return;
  std::vector<Verdict> failed;
  for (const auto& [r, v] : confirmed_) failed.push_back(v);
  StoreRequest req{StoreRequest::Kind::kPropose, gen_->number + 1, gen_->next(failed), {}, false, gen_};
  proposing_ = req.number;
  ++counters_.proposals;
  store_requests_.push_back(std::move(req));
}

void DetectorCore::request_read(uint64_t number, std::vector<Verdict> hint, bool complete,
                                TimePoint now) {
  if (number <= gen_->number) return;
  if (reading_ >= number && now < read_retry_at_) return;  // already asked
  reading_ = number;
  read_retry_at_ = now + opt_.store_retry;
  store_requests_.push_back(
      {StoreRequest::Kind::kRead, number, Generation{}, std::move(hint), complete, gen_});
}

void DetectorCore::on_store_error(const StoreRequest& req, TimePoint now) {
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
  for (int32_t r : targets) send(r, note);
}

void DetectorCore::tick(TimePoint now) {
  if (evicted_) return;
  if (now >= next_ping_) {
    for (int32_t r : watched_) {
      Message ping;
      ping.type = MsgType::kPing;
      ping.seq = ++seq_;
      ping.time_ns = now.time_since_epoch().count();
      ping.step = step_;
      ++counters_.pings_sent;
      send(r, std::move(ping));
    }
    next_ping_ += opt_.heartbeat_interval;
    if (next_ping_ <= now) next_ping_ = now + opt_.heartbeat_interval;
  }
  for (auto& [r, p] : peers_) {
    if (confirmed_.count(r)) continue;
    bool suspect = p.est.phi(now) >= opt_.phi_threshold || p.est.silence(now) >= opt_.max_silence;
    if (suspect && !p.suspected) {
      p.suspected = true;
      ++counters_.suspicions;
      events_.push_back({Event::Kind::kSuspect, now, r, gen_->number, {}, ""});
    } else if (!suspect && p.suspected) {
      p.suspected = false;
      ++counters_.unsuspicions;
      events_.push_back({Event::Kind::kUnsuspect, now, r, gen_->number, {}, ""});
    }
    if (!p.suspected) continue;
    std::vector<int32_t> others = watchers_of(r);
    others.erase(std::remove(others.begin(), others.end(), opt_.rank), others.end());
    // Tell the other watchers, again every few intervals in case a report was lost.
    if (now - p.last_suspect_sent >= 5 * opt_.heartbeat_interval) {
      p.last_suspect_sent = now;
      Message m;
      m.type = MsgType::kSuspect;
      m.verdicts = {Verdict{r, Reason::kUnresponsive, ""}};
      for (int32_t w : others) send(w, m);
    }
    size_t agree = 0;
    for (const auto& [who, when] : reports_[r]) {
      if (now - when <= opt_.report_ttl && gen_->contains(who)) ++agree;
    }
    if (others.empty() || agree >= 1) confirm(r, Reason::kUnresponsive, now);
  }
  maybe_propose(now);
}

std::vector<PeerStats> DetectorCore::peer_stats(TimePoint now) const {
  std::vector<PeerStats> out;
  for (const auto& [r, p] : peers_) {
    out.push_back({r, p.est.phi(now), p.rtt_ms, p.est.mean_ms(), p.suspected});
  }
  return out;
}

}  // namespace resilient::detect
