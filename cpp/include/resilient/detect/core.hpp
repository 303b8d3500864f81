#pragma once
// The failure detector's decision logic as a pure state machine: no sockets, no threads, no clock
// reads. Callers feed it messages, unreachable-peer signals, decided generations and ticks, each
// with `now`, and drain what it wants sent, proposed, read, and reported.
//
// Each rank watches the `watch_count` live ranks after it on a ring (so load does not grow with
// world size): it pings them every heartbeat interval and feeds the acks into a phi-accrual
// estimator. A watcher that suspects a peer tells the peer's other watchers; a peer is confirmed
// failed when two watchers suspect it (one if it has only one, or if every other watcher is
// silent to this one too, suspected or confirmed, for max_silence beyond the suspicion: ranks
// lost together), or at once when the peer itself announces its failure (an authenticated,
// fresh kSuspect with kFlagHard about its sender).
// Nothing unauthenticated confirms anything: a refusal (ICMP port unreachable, which anyone can
// spoof) only makes the watcher probe faster and, if no authenticated ack follows for
// `refused_silence`, suspect; the second watcher is still needed. Claims about other ranks count
// as their sender's suspicion, and only from a watcher of that rank. Every datagram passes the
// ReplayGuard (freshness.hpp) before it counts; an ack counts only as the answer to a ping this
// rank sent within the freshness window. Confirmed failures become a proposal for the next
// generation (see membership.hpp), which the driver decides by compare-and-set on the store. A
// decided generation is announced to `gossip_fanout` random live ranks plus the ring successors,
// each forwarding once; pings and acks carry the generation number as a fallback. An announcement
// is a hint: the receiver reads the record from the store before acting on it.

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "resilient/common/clock.hpp"
#include "resilient/detect/freshness.hpp"
#include "resilient/detect/membership.hpp"
#include "resilient/detect/phi.hpp"
#include "resilient/detect/wire.hpp"

namespace resilient::detect {

/// Settings of one rank's detector. Defaults come from RESILIENT_DETECT_* (docs/SETTINGS.md).
struct CoreOptions {
  int32_t rank = 0;
  int32_t world_size = 1;
  int watch_count = 3;
  Duration heartbeat_interval = std::chrono::milliseconds(100);
  double phi_threshold = 8.0;
  PhiOptions phi;
  /// Silence after which a peer is suspected whatever phi says (upper bound on detection).
  Duration max_silence = std::chrono::milliseconds(2500);
  /// Silence after which a peer whose address refused at least twice since its last ack is
  /// suspected (a killed process: ~3 heartbeats instead of the phi threshold's ~16).
  Duration refused_silence = std::chrono::milliseconds(300);
  /// Datagrams held back longer than this (relative to the fastest seen from their sender) and
  /// acks to pings older than this are dropped as replays.
  Duration freshness_window = std::chrono::seconds(5);
  /// How long another watcher's suspicion report counts toward confirmation.
  Duration report_ttl = std::chrono::seconds(5);
  int gossip_fanout = 3;
  /// Wait before re-proposing or re-reading a generation whose store call failed.
  Duration store_retry = std::chrono::milliseconds(500);
  uint64_t seed = 1;

  /// Defaults with RESILIENT_DETECT_* overrides applied, then validate()d.
  /// Errors: kInvalidArgument naming a malformed variable or an out-of-range value.
  static Result<CoreOptions> from_env(int32_t rank, int32_t world_size);

  /// kInvalidArgument naming the first bad field: 0 <= rank < world_size, watch_count >= 1,
  /// heartbeat_interval > 0, phi_threshold > 0, max_silence, refused_silence, freshness_window
  /// and report_ttl > 0, gossip_fanout >= 0, store_retry >= 0.
  Status validate() const;
};

struct Outgoing {
  int32_t to;
  Message msg;
};

/// Work for the driver's store thread: propose `proposal` or resolve generation `number`.
struct StoreRequest {
  enum class Kind { kPropose, kRead } kind;
  uint64_t number = 0;
  Generation proposal;  ///< kPropose only
  GenerationPtr base;   ///< the generation the rank is at
};

struct Event {
  enum class Kind { kSuspect, kUnsuspect, kConfirm, kGeneration, kEvicted, kHang };
  Kind kind;
  TimePoint at;
  int32_t rank = -1;  ///< the peer (or self for kHang/kEvicted)
  uint64_t generation = 0;
  std::vector<Verdict> removed;  ///< kGeneration: ranks no longer live
  std::string detail;            ///< reason or section
};
const char* event_kind_name(Event::Kind k);

struct PeerStats {
  int32_t rank;
  double phi;
  double rtt_ms;  ///< EWMA of ping round trips; <0 before the first ack
  double mean_interval_ms;
  bool suspected;
};

struct Counters {
  uint64_t messages_sent = 0, messages_received = 0, pings_sent = 0, acks_received = 0;
  uint64_t suspicions = 0, unsuspicions = 0, confirmations = 0, proposals = 0, generations = 0;
  uint64_t store_errors = 0;
  uint64_t refusals = 0;             ///< refusal signals (ICMP port unreachable) taken as hints
  uint64_t dropped_replay = 0;       ///< duplicates and sequence numbers below the window
  uint64_t dropped_stale = 0;        ///< outside the freshness window (incl. acks to old pings)
  uint64_t dropped_misdirected = 0;  ///< addressed to another rank, from self, or unknown sender
  uint64_t ignored_claims = 0;       ///< claims about another rank from a non-watcher
};

class DetectorCore {
 public:
  DetectorCore(CoreOptions opt, GenerationPtr initial, TimePoint now);

  // ---- inputs ----
  /// An authenticated datagram. Returns whether it was admitted (fresh, addressed to this rank,
  /// from another rank of the world); the driver may trust its source address only then.
  bool on_message(const Message& msg, TimePoint now);
  /// The peer's address refused a datagram (ICMP port unreachable). Unauthenticated, so only a
  /// hint: the peer is probed faster and suspected if no ack follows for refused_silence.
  void on_unreachable(int32_t peer, TimePoint now);
  /// A generation decided by the store (proposal result or read). Older ones are ignored.
  void on_generation(GenerationPtr g, TimePoint now);
  /// A store request failed; it is retried after store_retry.
  void on_store_error(const StoreRequest& req, TimePoint now);
  /// This rank's own watchdog saw a hang: propose removing self with reason kHang, and announce
  /// it to this rank's watchers (a self-announcement confirms at once).
  void report_self(Verdict v, TimePoint now);
  /// Sends due pings, re-evaluates suspicion, proposes confirmed failures. A tick that comes
  /// max_silence after the previous one (the process was stopped) first reads the generations
  /// decided meanwhile from the store, so a rank the others removed learns it at once.
  void tick(TimePoint now);
  /// The step counter value carried on acks (for observers).
  void set_step(uint64_t step) { step_ = step; }

  // ---- outputs (drained) ----
  std::vector<Outgoing> take_outbox() { return std::exchange(outbox_, {}); }
  std::vector<StoreRequest> take_store_requests() { return std::exchange(store_requests_, {}); }
  std::vector<Event> take_events() { return std::exchange(events_, {}); }

  // ---- queries ----
  const GenerationPtr& generation() const { return gen_; }
  const std::vector<int32_t>& watched() const { return watched_; }
  bool evicted() const { return evicted_; }
  std::vector<PeerStats> peer_stats(TimePoint now) const;
  const Counters& counters() const { return counters_; }
  TimePoint next_deadline() const { return next_ping_; }
  const CoreOptions& options() const { return opt_; }

 private:
  struct Peer {
    PhiEstimator est;
    uint64_t last_echo = 0;  // seq of the newest ping answered
    double rtt_ms = -1;
    bool suspected = false;
    TimePoint suspected_since{};  // when `suspected` last became true
    TimePoint last_suspect_sent{};
    uint32_t refusals = 0;   // since the last ack
    TimePoint next_probe{};  // fast probing while refusals > 0
  };

  void adopt(GenerationPtr g, TimePoint now);
  void rewatch(TimePoint now);
  void send(int32_t to, Message msg, TimePoint now);
  void ping(int32_t to, TimePoint now);
  void tell_watchers(int32_t peer, bool retract, TimePoint now);
  void on_suspect_message(const Message& m, TimePoint now);
  void confirm(Verdict v, TimePoint now);
  void maybe_propose(TimePoint now);
  void request_read(uint64_t number, TimePoint now);
  std::vector<int32_t> watchers_of(int32_t peer) const;
  bool seconded_by_none(int32_t peer, const std::vector<int32_t>& others, TimePoint now) const;

  CoreOptions opt_;
  GenerationPtr gen_;
  bool evicted_ = false;
  std::vector<int32_t> watched_;
  std::map<int32_t, Peer> peers_;
  std::map<int32_t, std::map<int32_t, TimePoint>> reports_;  // peer -> reporter -> when
  std::map<int32_t, Verdict> confirmed_;                     // awaiting a generation
  ReplayGuard replay_;
  uint64_t seq_ = 0;
  uint64_t step_ = 0;
  TimePoint next_ping_;
  TimePoint last_tick_{};     // the previous tick (a gap of max_silence: this process stood)
  bool catching_up_ = false;  // reading the generations decided while it stood, in turn
  uint64_t proposing_ = 0;    // generation number in flight (0: none)
  TimePoint store_retry_at_{};
  uint64_t reading_ = 0;
  TimePoint read_retry_at_{};
  std::mt19937_64 rng_;
  std::vector<Outgoing> outbox_;
  std::vector<StoreRequest> store_requests_;
  std::vector<Event> events_;
  Counters counters_;
};

}  // namespace resilient::detect
