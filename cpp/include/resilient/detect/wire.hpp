#pragma once
// Detector wire format: one authenticated UDP datagram per message.
//
// Layout (little-endian), version 2: magic u32 'RSDT' | version u8 | type u8 | flags u16 |
// job u64 | run u64 | from i32 | to i32 | generation u64 | seq u64 | time_ns i64 |
// echo_seq u64 | echo_time_ns i64 | step u64 | n u16 |
// n x (rank i32, reason u8, section_len u8, section bytes) | HMAC-SHA256(all preceding) 32 bytes.
//
// The MAC key is derived from the job key, the job id and the run id (HMAC-SHA256(key,
// "resilient-detect/2" | job | run id)), so a datagram of one run never authenticates in another
// even when the job key is reused; the header names the run (64-bit hash) and the destination
// rank, so it cannot be redirected to another rank either. `seq` is the sender's message counter
// (from 1, per run) and `time_ns` its monotonic clock at sending: the receiver's ReplayGuard
// (freshness.hpp) drops duplicates, old sequence numbers and datagrams outside the freshness
// window. Version 1 datagrams (no run, no destination) are dropped as kBadVersion, never parsed.
// Anything that fails to parse or authenticate is rejected with a reason the caller counts.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "resilient/common/status.hpp"

namespace resilient::detect {

/// Largest datagram this format produces or accepts.
inline constexpr size_t kMaxDatagram = 1400;
inline constexpr size_t kMacSize = 32;

enum class MsgType : uint8_t {
  kPing = 1,        ///< watcher -> watched: "are you there"; echoed by kAck
  kAck = 2,         ///< reply to kPing, echoes seq and time_ns
  kSuspect = 3,     ///< to the other watchers of a peer: "I suspect/confirm these"
  kGeneration = 4,  ///< gossip: generation `generation` was decided; verdicts = its removals
};

/// Why a rank left the live set.
enum class Reason : uint8_t {
  kCrash = 1,         ///< process gone: its port refused and it stayed silent (two watchers)
  kUnresponsive = 2,  ///< phi-accrual suspicion confirmed by more than one watcher
  kHang = 3,          ///< alive but its training step stopped advancing
};
const char* reason_name(Reason r);

/// One verdict about one rank. `section` is set for hangs ("step", "startup", "checkpoint").
struct Verdict {
  int32_t rank = -1;
  Reason reason = Reason::kUnresponsive;
  std::string section;
  bool operator==(const Verdict&) const = default;
};

/// Flag on kGeneration: the verdict list is the complete set of removals.
inline constexpr uint16_t kFlagComplete = 1;
/// Flag on kSuspect: a verdict about the sender itself is final (a rank announcing its own
/// failure, e.g. a hang its watchdog saw). On verdicts about other ranks it is ignored: those
/// count as one watcher's suspicion only (see DetectorCore::on_message).
inline constexpr uint16_t kFlagHard = 2;
/// Flag on kSuspect: the sender no longer suspects these ranks (it heard from them again).
inline constexpr uint16_t kFlagRetract = 4;

/// Current wire version (older versions are dropped and counted).
inline constexpr uint8_t kWireVersion = 2;

struct Message {
  MsgType type = MsgType::kPing;
  uint16_t flags = 0;
  uint64_t job = 0;
  uint64_t run = 0;
  int32_t from = -1;
  int32_t to = -1;  ///< destination rank
  uint64_t generation = 0;
  uint64_t seq = 0;          ///< sender's message counter, from 1, per run
  int64_t time_ns = 0;       ///< sender's monotonic clock when sent
  uint64_t echo_seq = 0;     ///< kAck: the ping's seq
  int64_t echo_time_ns = 0;  ///< kAck: the ping's time_ns (the watcher's own clock)
  uint64_t step = 0;
  std::vector<Verdict> verdicts;
  bool operator==(const Message&) const = default;
};

/// Why a datagram was dropped.
enum class DropReason { kNone, kMalformed, kBadMac, kOtherJob, kOtherRun, kBadVersion };

/// Encodes and authenticates messages with a per-run HMAC-SHA256 key. Thread-safe (immutable).
class Codec {
 public:
  /// `key`: the job secret (any length, >= 16 bytes recommended); `job`: the job id, a hash of
  /// the job name, so packets of another job are told apart from forged ones; `run`: the run id
  /// (one per launch of the job, see docs/SECURITY.md), part of the MAC key and the header.
  Codec(std::string key, uint64_t job, std::string_view run = {});

  /// Serialises `msg` (its job and run fields are overwritten with this codec's). Verdicts that
  /// do not fit in kMaxDatagram are left out and kFlagComplete is cleared.
  std::string encode(Message msg) const;

  /// Parses and verifies one datagram. Errors: kCorrupt (malformed or another wire version),
  /// kFailedPrecondition (bad MAC), kNotFound (another job's or run's packet). `drop` (optional)
  /// gets the reason.
  Result<Message> decode(std::string_view datagram, DropReason* drop = nullptr) const;

  uint64_t job() const { return job_; }
  uint64_t run() const { return run_; }

 private:
  std::string mac_key_;
  uint64_t job_;
  uint64_t run_;
};

/// Stable 64-bit id of a job name (FNV-1a).
uint64_t job_id(std::string_view job_name);
/// Stable 64-bit id of a run id (FNV-1a; the MAC key uses the full string).
inline uint64_t run_hash(std::string_view run_id) { return job_id(run_id); }

}  // namespace resilient::detect
