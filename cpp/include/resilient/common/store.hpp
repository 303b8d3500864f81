#pragma once
// The job's key/value store: the one interface through which ranks agree on things outside the
// training collectives (the detector's membership generations, the communicator's NCCL unique
// ids). torch.distributed's TCPStore serves it today through the Python adapter in the bindings;
// an etcd backend will implement the same contract. InMemoryStore serves tests and single-process
// runs.
//
// Contract every implementation keeps:
// - Keys and values are byte strings (values may hold NULs). Keys are never deleted: once a key
//   exists it exists for the store's lifetime (callers scope keys by run and generation instead).
// - Every call is bounded by its `timeout`: it returns within about `timeout` (plus scheduling
//   slack), with kTimeout when the store itself did not answer in time. A zero timeout allows a
//   store that answers at once (InMemoryStore always does) and fails fast otherwise.
// - kUnavailable: the store is unreachable or failed (connection refused, server gone, an error
//   the backend cannot classify). The caller may retry.
// - Operations on one key are linearizable: a get that starts after a set returns has the value
//   (or a later one); compare_set is atomic with respect to every other call.
// - Implementations are thread-safe.

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"

namespace resilient {

/// What get() does when the key does not exist (yet).
enum class IfAbsent {
  kFail,  ///< return kNotFound at once (the call is still bounded by its timeout)
  kWait,  ///< wait for another caller to set it, until the timeout: then kTimeout
};

/// The job's key/value store (see the contract above). Thread-safe.
class Store {
 public:
  virtual ~Store() = default;

  /// Sets `key` to `value`, overwriting any value. Errors: kTimeout, kUnavailable.
  virtual Status set(const std::string& key, const std::string& value, Duration timeout) = 0;

  /// The value of `key`. An absent key is kNotFound at once (IfAbsent::kFail), or is waited for
  /// until `timeout` and then kTimeout (IfAbsent::kWait). Errors: also kUnavailable.
  virtual Result<std::string> get(const std::string& key, Duration timeout, IfAbsent if_absent) = 0;

  /// Atomically: when `key` holds `expected`, or is absent and `expected` is empty, sets it to
  /// `desired`. Returns the value the key holds after the call: `desired` when this call or an
  /// earlier one wrote it, else the other value that won. An absent key with a non-empty
  /// `expected` is left absent: kNotFound. (The first writer of a key wins with
  /// compare_set(key, "", value): every caller gets the winner's value back.)
  /// Errors: also kTimeout, kUnavailable.
  virtual Result<std::string> compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired, Duration timeout) = 0;
};

/// A process-local Store for tests, the simulator and single-process use. get(kWait) waits on a
/// condition variable in real time. set_unavailable(true) models an unreachable store.
class InMemoryStore final : public Store {
 public:
  Status set(const std::string& key, const std::string& value, Duration timeout) override;
  Result<std::string> get(const std::string& key, Duration timeout, IfAbsent if_absent) override;
  Result<std::string> compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired, Duration timeout) override;

  /// While true every call fails with kUnavailable (a waiting get fails when it is switched on).
  void set_unavailable(bool unavailable);
  /// Calls made so far (every method above), for tests and the simulator's cost report.
  size_t calls() const;
  /// Keys set so far.
  size_t size() const;

 private:
  Status check_available() const;  // mu_ held

  mutable std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::string> kv_;
  bool unavailable_ = false;
  size_t calls_ = 0;
};

}  // namespace resilient
