#include "resilient/common/store.hpp"

namespace resilient {

Status InMemoryStore::check_available() const {
  if (unavailable_) return Status(StatusCode::kUnavailable, "store unavailable");
  return ok_status();
}

Status InMemoryStore::set(const std::string& key, const std::string& value, Duration) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    RESILIENT_RETURN_IF_ERROR(check_available());
    kv_[key] = value;
  }
  changed_.notify_all();
  return ok_status();
}

Result<std::string> InMemoryStore::get(const std::string& key, Duration timeout,
                                       IfAbsent if_absent) {
  std::unique_lock<std::mutex> lock(mu_);
  ++calls_;
  RESILIENT_RETURN_IF_ERROR(check_available());
  auto it = kv_.find(key);
  if (it != kv_.end()) return it->second;
  if (if_absent == IfAbsent::kFail) return Status(StatusCode::kNotFound, "no store key " + key);
  changed_.wait_for(lock, timeout, [&] { return unavailable_ || kv_.count(key) != 0; });
  RESILIENT_RETURN_IF_ERROR(check_available());
  it = kv_.find(key);
  if (it == kv_.end()) {
    return Status(StatusCode::kTimeout, "store key '" + key + "' not set within " +
                                            std::to_string(to_seconds(timeout)) + " s");
  }
  return it->second;
}

Result<std::string> InMemoryStore::compare_set(const std::string& key, const std::string& expected,
                                               const std::string& desired, Duration) {
  std::string after;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    RESILIENT_RETURN_IF_ERROR(check_available());
    auto it = kv_.find(key);
    if (it == kv_.end()) {
      if (!expected.empty()) return Status(StatusCode::kNotFound, "no store key " + key);
      it = kv_.emplace(key, desired).first;
    } else if (it->second == expected) {
      it->second = desired;
    }
    after = it->second;
  }
  changed_.notify_all();
  return after;
}

void InMemoryStore::set_unavailable(bool unavailable) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    unavailable_ = unavailable;
  }
  changed_.notify_all();
}

size_t InMemoryStore::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

size_t InMemoryStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_.size();
}

}  // namespace resilient
