#pragma once
// Agreed membership: a generation number and the set of live ranks.
//
// Protocol. Generation g's record lives at key "<prefix>/gen/<g>" in the job's store. Generation 0
// is the full world. A rank that has confirmed failures while at generation g proposes g+1 =
// live(g) minus the failed ranks with compare_set(key(g+1), expected="", desired=record): the first
// writer wins and every other proposer gets the winner's record back, so each generation is decided
// exactly once and no two ranks can act on different views of the same generation. Failures the
// winner did not include are proposed again for g+2. Ranks learn that g+1 exists through gossip
// (kGeneration messages, and every ping/ack's generation field) and then read its record from the
// store: a datagram is only a hint, so no key holder can remove a rank by announcing a generation.
// Keys are scoped to one run (the prefix names the run id), so a store that outlives a run never
// hands its records to the next one. The store's host is the one single
// point of failure left (until an etcd backend exists); it must run outside the training ranks.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"
#include "resilient/common/store.hpp"
#include "resilient/detect/wire.hpp"

namespace resilient::detect {

/// One decided generation. Immutable once built; shared between holders.
struct Generation {
  uint64_t number = 0;
  std::vector<int32_t> live;     ///< sorted ascending
  std::vector<Verdict> removed;  ///< ranks removed going from number-1 to number

  bool contains(int32_t rank) const;
  /// Text form stored in the store: "g=<n>;live=<a-b,c,...>;removed=<rank:reason:section,...>".
  std::string serialize() const;
  static Result<Generation> parse(std::string_view text);
  /// live(this) minus `failed` as generation number+1 (ranks not live are ignored).
  Generation next(const std::vector<Verdict>& failed) const;
  /// Generation 0 of a world of `world_size` ranks.
  static Generation initial(int32_t world_size);
};
using GenerationPtr = std::shared_ptr<const Generation>;

/// The `count` live ranks after `rank` on the ring (rank itself need not be live).
std::vector<int32_t> ring_successors(const std::vector<int32_t>& live, int32_t rank, int count);
/// The `count` live ranks before `rank` on the ring.
std::vector<int32_t> ring_predecessors(const std::vector<int32_t>& live, int32_t rank, int count);

/// Key of generation `g` under `prefix`.
std::string generation_key(const std::string& prefix, uint64_t g);

/// Proposes `proposal` (number g+1) and returns the record decided for that number (the proposal
/// or another rank's). Errors: the store's.
Result<Generation> decide_generation(Store& store, const std::string& prefix,
                                     const Generation& proposal, Duration timeout);

/// Reads generation `g` (without waiting for it). Errors: kNotFound if not decided yet, kCorrupt,
/// the store's.
Result<Generation> read_generation(Store& store, const std::string& prefix, uint64_t g,
                                   Duration timeout);

}  // namespace resilient::detect
