#pragma once
// The per-rank detector agent: runs DetectorCore and HangWatchdog on its own threads, with no
// GIL and no Python in the hot path.
//
// Threads: the network thread owns a UDP socket bound to the rank's address (pings from watchers
// arrive there and are answered from it) plus one connected UDP socket per watched peer, bound to
// the same IP (pings go out through it, acks come back on it, and a dead peer's ICMP
// port-unreachable surfaces there as ECONNREFUSED: a hint that makes the core probe faster, never
// a verdict, since ICMP is unauthenticated). A datagram counts only if it authenticates for this
// job and run, comes from the IP its sender published, and the core admits it (fresh, addressed
// here); only then may a ping's source port become the address acks go to. It ticks the core
// every `poll_interval`. The
// store thread performs compare-and-set proposals and generation reads, off the hot path. Events
// queue up for poll_events(); nothing calls back into the owner from these threads.

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"
#include "resilient/detect/core.hpp"
#include "resilient/detect/membership.hpp"
#include "resilient/detect/watchdog.hpp"
#include "resilient/detect/wire.hpp"

namespace resilient::detect {

struct AgentOptions {
  CoreOptions core;
  WatchdogOptions watchdog;
  bool hang_watchdog = true;
  std::string job = "default";
  std::string run_id;                  ///< one per launch of the job (docs/SECURITY.md)
  std::string key;                     ///< HMAC key (required, >= 16 bytes)
  std::vector<std::string> addresses;  ///< "ipv4:port" of every rank, indexed by rank
  std::string store_prefix = "resilient/detect";
  Duration store_timeout = std::chrono::seconds(5);
  Duration poll_interval = std::chrono::milliseconds(10);
  size_t max_events = 10000;  ///< oldest dropped past this
};

/// Datagram counters of the network thread.
struct WireCounters {
  uint64_t sent = 0, received = 0, send_errors = 0, refused = 0;
  uint64_t dropped_malformed = 0, dropped_bad_mac = 0, dropped_other_job = 0;
  uint64_t dropped_other_run = 0, dropped_version = 0, dropped_unknown_source = 0;
};

struct AgentMetrics {
  Counters core;
  WireCounters wire;
  std::vector<PeerStats> peers;
  uint64_t generation = 0;
  size_t live = 0;
  std::string section;
  double hang_limit_s = 0;
  uint64_t step = 0;
};

/// One rank's detector agent. Owns its threads and sockets (RAII, neither copyable nor movable:
/// the threads hold `this`). Public methods are thread-safe.
class Agent {
 public:
  /// Binds the rank's socket (addresses[core.rank]); does not start threads.
  /// Errors: kInvalidArgument (bad address/key), kIoError (bind).
  static Result<std::unique_ptr<Agent>> create(AgentOptions opt, std::shared_ptr<Store> store,
                                               GenerationPtr initial);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  /// Replaces every rank's "ipv4:port" (e.g. once all ranks published their bound ports).
  /// Errors: kFailedPrecondition after start(), kInvalidArgument on a bad list.
  Status set_addresses(std::vector<std::string> addresses);
  /// Starts the threads. Errors: kFailedPrecondition if already started.
  Status start();
  /// Stops and joins the threads (idempotent; bounded by store_timeout for an in-flight call).
  void stop();

  /// Cheap, lock-free: the training loop's step counter.
  void set_step(uint64_t step) { step_.store(step, std::memory_order_relaxed); }
  void enter_section(const std::string& name);
  void leave_section();
  /// Waits up to `timeout` for events; returns those queued (maybe none). Thread-safe.
  std::vector<Event> poll_events(Duration timeout);
  AgentMetrics metrics();
  GenerationPtr generation();
  /// The UDP port actually bound (useful with port 0).
  int port() const { return port_; }

 private:
  Agent(AgentOptions opt, std::shared_ptr<Store> store, GenerationPtr initial, int fd, int port);
  void net_loop();
  void store_loop();
  void pump(TimePoint now);   // drains the core; mu_ held
  void sync_watch_sockets();  // mu_ held
  void send_one(const Outgoing& o);
  void handle_datagram(const char* data, size_t n, const void* from, unsigned from_len,
                       int32_t via_peer, TimePoint now);

  AgentOptions opt_;
  std::shared_ptr<Store> store_;
  Codec codec_;
  int fd_;
  int port_;
  std::vector<std::string> addr_bytes_;  // sockaddr_in per rank, as bytes

  std::mutex mu_;  // guards core_, watchdog_, watch_fds_, reply_addr_, counters
  DetectorCore core_;
  HangWatchdog watchdog_;
  std::vector<std::pair<int32_t, int>> watch_fds_;  // peer -> connected socket
  std::vector<std::string> reply_addr_;             // last admitted ping source per rank
  WireCounters wire_;
  std::deque<StoreRequest> store_queue_;
  std::condition_variable store_cv_;

  std::mutex ev_mu_;
  std::condition_variable ev_cv_;
  std::deque<Event> events_;

  std::atomic<uint64_t> step_{0};
  std::atomic<bool> running_{false};
  std::thread net_thread_, store_thread_;
};

}  // namespace resilient::detect
