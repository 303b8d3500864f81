#include "resilient/common/config.hpp"

#include <cctype>
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

[[noreturn]] void bad_env(const char* name, const std::string& value, const std::string& why) {
  throw std::invalid_argument(std::string(name) + "='" + value + "': " + why);
}

}  // namespace

Result<Feature> parse_feature(std::string_view text) {
  std::string t = lower(trim(text));
  if (t == "auto") return Feature::kAuto;
  if (t == "on" || t == "1" || t == "true" || t == "yes") return Feature::kOn;
  if (t == "off" || t == "0" || t == "false" || t == "no") return Feature::kOff;
  return Status(StatusCode::kInvalidArgument, "expected auto, on or off, got '" + std::string(text) + "'");
}

const char* feature_name(Feature f) {
  switch (f) {
    case Feature::kAuto: return "auto";
    case Feature::kOn: return "on";
    case Feature::kOff: return "off";
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
  if (suffix.empty() || suffix == "b") mult = 1;
  else if (suffix == "k" || suffix == "kb" || suffix == "kib") mult = 1024.0;
  else if (suffix == "m" || suffix == "mb" || suffix == "mib") mult = 1024.0 * 1024;
  else if (suffix == "g" || suffix == "gb" || suffix == "gib") mult = 1024.0 * 1024 * 1024;
  else if (suffix == "t" || suffix == "tb" || suffix == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else return Status(StatusCode::kInvalidArgument, "unknown size suffix in '" + std::string(text) + "'");
  double bytes = v * mult;
  if (bytes > 9.0e18) return Status(StatusCode::kInvalidArgument, "size too large: '" + std::string(text) + "'");
  return static_cast<uint64_t>(bytes);
}

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t env_int(const char* name, int64_t fallback) {
  auto v = env_string(name);
  if (!v) return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v->c_str(), &end, 10);
  if (end == v->c_str() || !trim(end).empty()) bad_env(name, *v, "not an integer");
  return x;
}

double env_double(const char* name, double fallback) {
  auto v = env_string(name);
  if (!v) return fallback;
  char* end = nullptr;
  double x = std::strtod(v->c_str(), &end);
  if (end == v->c_str() || !trim(end).empty() || !std::isfinite(x)) bad_env(name, *v, "not a number");
  return x;
}

bool env_bool(const char* name, bool fallback) {
  auto v = env_string(name);
  if (!v) return fallback;
  auto f = parse_feature(*v);
  if (!f.ok() || *f == Feature::kAuto) bad_env(name, *v, "expected on/off");
  return *f == Feature::kOn;
}

uint64_t env_bytes(const char* name, uint64_t fallback) {
  auto v = env_string(name);
  if (!v) return fallback;
  auto b = parse_bytes(*v);
  if (!b.ok()) bad_env(name, *v, b.status().message());
  return *b;
}

Feature env_feature(const char* name, Feature fallback) {
  auto v = env_string(name);
  if (!v) return fallback;
  auto f = parse_feature(*v);
  if (!f.ok()) bad_env(name, *v, f.status().message());
  return *f;
}

}  // namespace resilient
