#pragma once
// Minimal leveled logging to stderr (or a sink set from Python). RESILIENT_LOG_LEVEL picks the
// threshold: debug, info, warn (default), error.

#include <functional>
#include <sstream>
#include <string>
#include <string_view>

namespace resilient {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

bool log_enabled(LogLevel level);
void set_log_level(LogLevel level);
LogLevel log_level();
/// Writes one line. Thread-safe.
void log_message(LogLevel level, std::string_view message);
/// Logs `message` only the first time `key` is seen in this process (e.g. a backend fallback).
void log_once(const std::string& key, LogLevel level, std::string_view message);
/// Replaces the sink (nullptr restores stderr). The sink must be thread-safe.
void set_log_sink(std::function<void(LogLevel, std::string_view)> sink);

}  // namespace resilient

#define RESILIENT_LOG(level, expr)                                       \
  do {                                                                   \
    if (::resilient::log_enabled(::resilient::LogLevel::level)) {        \
      std::ostringstream _os;                                            \
      _os << expr;                                                       \
      ::resilient::log_message(::resilient::LogLevel::level, _os.str()); \
    }                                                                    \
  } while (0)
