#include "resilient/comm/store.hpp"

namespace resilient::comm {

Status InMemoryStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = value;
  }
  cv_.notify_all();
  return ok_status();
}

Result<std::string> InMemoryStore::get(const std::string& key, Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool found = cv_.wait_for(lock, timeout, [&] { return data_.count(key) != 0; });
  if (!found) {
    return Status(StatusCode::kTimeout, "store key '" + key + "' not set within " +
                                            std::to_string(to_seconds(timeout)) + " s");
  }
  return data_.at(key);
}

size_t InMemoryStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return data_.size();
}

}  // namespace resilient::comm
