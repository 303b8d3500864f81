#pragma once
// Typed settings with RESILIENT_* environment overrides. Each component keeps an options struct
// whose defaults come from these helpers; docs/SETTINGS.md lists every setting.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "resilient/common/status.hpp"

namespace resilient {

/// AUTO/ON/OFF for optional platform features (io_uring, O_DIRECT, CUDA, NCCL, NVML).
/// AUTO uses the feature when present and logs the fallback once; ON makes absence an error.
enum class Feature { kAuto, kOn, kOff };

Result<Feature> parse_feature(std::string_view text);
const char* feature_name(Feature f);

/// "16MiB", "4k", "1.5GiB", "4096" -> bytes. Suffixes are binary (k = KiB).
Result<uint64_t> parse_bytes(std::string_view text);

/// "42", " -7 " -> integer; anything else (trailing text, empty, out of range) is an error.
Result<int64_t> parse_int(std::string_view text);
/// A finite decimal number ("0.5", "1e3").
Result<double> parse_double(std::string_view text);
/// on/off, 1/0, true/false, yes/no (any case); "auto" and anything else are errors.
Result<bool> parse_bool(std::string_view text);

/// The environment variable's value, or nullopt when unset or empty.
std::optional<std::string> env_string(const char* name);

/// The variable `name` parsed by `parse` (one of the parse_* above), or `fallback` when it is
/// unset or empty. Errors: kInvalidArgument naming the variable and its value (a misconfigured
/// job should not start silently). Options structs' from_env() read through this.
template <typename T>
Result<T> env_value(const char* name, T fallback, Result<T> (*parse)(std::string_view)) {
  auto text = env_string(name);
  if (!text) return fallback;
  Result<T> v = parse(*text);
  if (!v.ok()) return Status(v.status()).prepend(std::string(name) + "='" + *text + "'");
  return v;
}

// Throwing forms for code that cannot return a Status (static initialisers): each returns
// `fallback` when the variable is unset; a set but malformed value throws std::invalid_argument
// naming the variable.
int64_t env_int(const char* name, int64_t fallback);
double env_double(const char* name, double fallback);
bool env_bool(const char* name, bool fallback);
uint64_t env_bytes(const char* name, uint64_t fallback);
Feature env_feature(const char* name, Feature fallback);

}  // namespace resilient
