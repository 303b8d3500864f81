#include "resilient/common/logging.hpp"

#include <atomic>
#include <cctype>
#include <cstdio>
#include <mutex>
#include <set>

#include "resilient/common/config.hpp"

namespace resilient {
namespace {

// RESILIENT_LOG_LEVEL (any case), else warn. Read by a static initialiser, which cannot fail:
// a value that names no level says so on stderr once and logs at warn.
LogLevel initial_level() {
  auto v = env_string("RESILIENT_LOG_LEVEL");
  if (!v) return LogLevel::kWarn;
  std::string level;
  for (char c : *v) level += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (level == "debug") return LogLevel::kDebug;
  if (level == "info") return LogLevel::kInfo;
  if (level == "warn") return LogLevel::kWarn;
  if (level == "error") return LogLevel::kError;
  std::fprintf(stderr,
               "resilient: RESILIENT_LOG_LEVEL='%s' is not debug, info, warn or error; logging "
               "at warn\n",
               v->c_str());
  return LogLevel::kWarn;
}

std::atomic<int>& level_ref() {
  static std::atomic<int> level{static_cast<int>(initial_level())};
  return level;
}

struct SinkState {
  std::mutex mu;
  std::function<void(LogLevel, std::string_view)> sink;
  std::set<std::string> once_keys;
};

SinkState& state() {
  static SinkState* s = new SinkState();  // never destroyed: safe during static teardown
  return *s;
}

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
  }
  return "?";
}

}  // namespace

bool log_enabled(LogLevel level) { return static_cast<int>(level) >= level_ref().load(); }
void set_log_level(LogLevel level) { level_ref() = static_cast<int>(level); }
LogLevel log_level() { return static_cast<LogLevel>(level_ref().load()); }

void log_message(LogLevel level, std::string_view message) {
  auto& s = state();
  std::function<void(LogLevel, std::string_view)> sink;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    sink = s.sink;
  }
  if (sink) {
    sink(level, message);
    return;
  }
  std::fprintf(stderr, "[resilient %s] %.*s\n", level_name(level), static_cast<int>(message.size()),
               message.data());
}

void log_once(const std::string& key, LogLevel level, std::string_view message) {
  if (!log_enabled(level)) return;
  {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.once_keys.insert(key).second) return;
  }
  log_message(level, message);
}

void set_log_sink(std::function<void(LogLevel, std::string_view)> sink) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.sink = std::move(sink);
}

}  // namespace resilient
