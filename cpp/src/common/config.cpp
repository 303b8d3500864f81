#include "resilient/common/config.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace resilient {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

template <typename T>
T value_or_throw(Result<T> r) {
  if (!r.ok()) throw std::invalid_argument(r.status().message());
  return std::move(r).value();
}

}  // namespace

Result<Feature> parse_feature(std::string_view text) {
  std::string t = lower(trim(text));
  if (t == "auto") return Feature::kAuto;
  if (t == "on" || t == "1" || t == "true" || t == "yes") return Feature::kOn;
  if (t == "off" || t == "0" || t == "false" || t == "no") return Feature::kOff;
  return Status(StatusCode::kInvalidArgument,
                "expected auto, on or off, got '" + std::string(text) + "'");
}

const char* feature_name(Feature f) {
  switch (f) {
    case Feature::kAuto:
      return "auto";
    case Feature::kOn:
      return "on";
    case Feature::kOff:
      return "off";
  }
  return "?";
}

Result<uint64_t> parse_bytes(std::string_view text) {
  std::string t = lower(trim(text));
  if (t.empty()) return Status(StatusCode::kInvalidArgument, "empty size");
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (end == t.c_str() || !std::isfinite(v) || v < 0) {
    return Status(StatusCode::kInvalidArgument, "not a size: '" + std::string(text) + "'");
  }
  std::string suffix = trim(std::string_view(end));
  double mult = 1;
  if (suffix.empty() || suffix == "b")
    mult = 1;
  else if (suffix == "k" || suffix == "kb" || suffix == "kib")
    mult = 1024.0;
  else if (suffix == "m" || suffix == "mb" || suffix == "mib")
    mult = 1024.0 * 1024;
  else if (suffix == "g" || suffix == "gb" || suffix == "gib")
    mult = 1024.0 * 1024 * 1024;
  else if (suffix == "t" || suffix == "tb" || suffix == "tib")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    return Status(StatusCode::kInvalidArgument,
                  "unknown size suffix in '" + std::string(text) + "'");
  double bytes = v * mult;
  if (bytes > 9.0e18)
    return Status(StatusCode::kInvalidArgument, "size too large: '" + std::string(text) + "'");
  return static_cast<uint64_t>(bytes);
}

Result<int64_t> parse_int(std::string_view text) {
  const std::string t = trim(text);
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(t.c_str(), &end, 10);
  if (t.empty() || end == t.c_str() || *end != '\0') {
    return Status(StatusCode::kInvalidArgument, "not an integer: '" + std::string(text) + "'");
  }
  if (errno == ERANGE) {
    return Status(StatusCode::kInvalidArgument,
                  "integer out of range: '" + std::string(text) + "'");
  }
  return static_cast<int64_t>(x);
}

Result<double> parse_double(std::string_view text) {
  const std::string t = trim(text);
  char* end = nullptr;
  const double x = std::strtod(t.c_str(), &end);
  if (t.empty() || end == t.c_str() || *end != '\0' || !std::isfinite(x)) {
    return Status(StatusCode::kInvalidArgument, "not a number: '" + std::string(text) + "'");
  }
  return x;
}

Result<bool> parse_bool(std::string_view text) {
  auto f = parse_feature(text);
  if (!f.ok() || *f == Feature::kAuto) {
    return Status(StatusCode::kInvalidArgument,
                  "expected on/off (1/0, true/false, yes/no), got '" + std::string(text) + "'");
  }
  return *f == Feature::kOn;
}

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t env_int(const char* name, int64_t fallback) {
  return value_or_throw(env_value(name, fallback, parse_int));
}

double env_double(const char* name, double fallback) {
  return value_or_throw(env_value(name, fallback, parse_double));
}

bool env_bool(const char* name, bool fallback) {
  return value_or_throw(env_value(name, fallback, parse_bool));
}

uint64_t env_bytes(const char* name, uint64_t fallback) {
  return value_or_throw(env_value(name, fallback, parse_bytes));
}

Feature env_feature(const char* name, Feature fallback) {
  return value_or_throw(env_value(name, fallback, parse_feature));
}

}  // namespace resilient
