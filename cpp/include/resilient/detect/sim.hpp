#pragma once
// Discrete-event simulation of the failure detector at scale: drives the real DetectorCore of
// every rank over a modelled network (latency + exponential jitter, random loss) and store
// (fixed round trip, never fails), injecting crashes (port refuses), silent failures (frozen
// host), and short pauses that must NOT be reported. Single-threaded and deterministic per seed.

#include <cstdint>

#include "resilient/detect/core.hpp"

namespace resilient::detect {

struct SimOptions {
  int ranks = 1024;
  double duration_s = 15;
  double warmup_s = 3;      ///< failures are injected after this
  double latency_ms = 0.3;  ///< one-way base latency
  double jitter_ms = 0.5;   ///< mean of the exponential extra delay
  double loss = 0.001;      ///< per-datagram loss probability
  int crashes = 3;          ///< processes killed (their port refuses: fast path)
  int silent_failures = 2;  ///< hosts frozen (no refusal: phi-accrual path)
  int pauses = 5;           ///< ranks paused for pause_ms then resumed (must survive)
  double pause_ms = 600;
  double store_latency_ms = 2;  ///< compare-and-set / read round trip
  double tick_ms = 10;          ///< agent poll interval
  int phi_window = 32;
  uint64_t seed = 1;
  CoreOptions core;  ///< rank/world are filled in per rank
};

struct SimReport {
  int ranks = 0;
  double sim_seconds = 0, wall_seconds = 0;
  int failures = 0, undetected = 0;
  /// Failure -> every survivor has adopted a generation without the failed rank.
  double detect_all_p50_ms = 0, detect_all_p99_ms = 0, detect_all_max_ms = 0;
  double crash_p50_ms = 0, silent_p50_ms = 0;
  /// Failure -> one survivor learns it, over all (failure, survivor) pairs.
  double per_rank_p50_ms = 0, per_rank_p99_ms = 0;
  int false_positives = 0;        ///< healthy (incl. paused) ranks removed
  uint64_t false_suspicions = 0;  ///< suspect events about ranks that had not failed
  double messages_per_rank_per_s = 0;
  uint64_t store_ops = 0;
  double store_ops_per_s = 0;       ///< store_ops / sim_seconds
  double store_peak_ops_per_s = 0;  ///< the busiest 100 ms of simulated time, per second
  uint64_t generations = 0;
  bool agreed = false;  ///< all survivors end on the same generation and live set
};

/// Runs one simulation. Cost grows with ranks x duration / tick.
SimReport run_simulation(const SimOptions& opt);

}  // namespace resilient::detect
