#pragma once
// Detector wire format: one authenticated UDP datagram per message.
//
// Layout (little-endian): magic u32 'RSDT' | version u8 | type u8 | flags u16 | job u64 |
// from i32 | generation u64 | seq u64 | time_ns i64 | step u64 | n u16 |
// n x (rank i32, reason u8, section_len u8, section bytes) | HMAC-SHA256(all preceding) 32 bytes.
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
  kCrash = 1,         ///< process gone (connection refused): hard evidence
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
/// Flag on kSuspect: the sender has hard evidence (refused), confirm without a second watcher.
inline constexpr uint16_t kFlagHard = 2;

struct Message {
  MsgType type = MsgType::kPing;
  uint16_t flags = 0;
  uint64_t job = 0;
  int32_t from = -1;
  uint64_t generation = 0;
  uint64_t seq = 0;
  int64_t time_ns = 0;
  uint64_t step = 0;
  std::vector<Verdict> verdicts;
  bool operator==(const Message&) const = default;
};

/// Why a datagram was dropped.
enum class DropReason { kNone, kMalformed, kBadMac, kOtherJob };

/// Encodes and authenticates messages with a per-job HMAC-SHA256 key. Thread-safe (immutable).
class Codec {
 public:
  /// `key`: the job secret (any length, >= 16 bytes recommended); `job`: the job id, a hash of
  /// the job name, so packets of another job are told apart from forged ones.
  Codec(std::string key, uint64_t job);

  /// Serialises `msg` (its job field is overwritten with this codec's job). Verdicts that do not
  /// fit in kMaxDatagram are left out and kFlagComplete is cleared.
  std::string encode(Message msg) const;

  /// Parses and verifies one datagram. Errors: kCorrupt (malformed), kFailedPrecondition
  /// (bad MAC), kNotFound (another job's packet). `drop` (optional) gets the reason.
  Result<Message> decode(std::string_view datagram, DropReason* drop = nullptr) const;

  uint64_t job() const { return job_; }

 private:
  std::string key_;
  uint64_t job_;
};

/// Stable 64-bit id of a job name (FNV-1a).
uint64_t job_id(std::string_view job_name);

}  // namespace resilient::detect
