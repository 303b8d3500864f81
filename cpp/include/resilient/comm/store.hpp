#pragma once
// A minimal key/value store for exchanging NCCL unique ids between ranks. Kept deliberately
// small (set, get-with-deadline); a torch.distributed Store or the detector's store can be
// adapted to it. Keys are namespaced by the caller ("resilient/comm/<name>/gen<g>/...").

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"

namespace resilient::comm {

/// Key/value store shared by the ranks of a job. Implementations must be thread-safe.
class Store {
 public:
  virtual ~Store() = default;
  /// Sets `key` to `value` (overwrites). Errors: Unavailable when the store is unreachable.
  virtual Status set(const std::string& key, const std::string& value) = 0;
  /// Returns the value of `key`, waiting up to `timeout` for it to be set.
  /// Errors: Timeout when it is still absent at the deadline; Unavailable when unreachable.
  virtual Result<std::string> get(const std::string& key, Duration timeout) = 0;
};

/// An in-process Store (tests, single-process use). Thread-safe; get() waits on a condition
/// variable in real time.
class InMemoryStore final : public Store {
 public:
  Status set(const std::string& key, const std::string& value) override;
  Result<std::string> get(const std::string& key, Duration timeout) override;
  /// Number of keys set so far.
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
};

}  // namespace resilient::comm
