#include "resilient/comm/options.hpp"

#include <stdexcept>

namespace resilient::comm {

Result<RebuildMode> parse_rebuild_mode(std::string_view text) {
  if (text == "auto") return RebuildMode::kAuto;
  if (text == "shrink") return RebuildMode::kShrink;
  if (text == "reinit") return RebuildMode::kReinit;
  return Status(StatusCode::kInvalidArgument,
                "rebuild mode must be auto, shrink or reinit, not '" + std::string(text) + "'");
}

const char* rebuild_mode_name(RebuildMode mode) {
  switch (mode) {
    case RebuildMode::kAuto:
      return "auto";
    case RebuildMode::kShrink:
      return "shrink";
    case RebuildMode::kReinit:
      return "reinit";
  }
  return "?";
}

CommOptions CommOptions::from_env() {
  CommOptions o;
  auto seconds = [](const char* name, Duration fallback) {
    double s = env_double(name, to_seconds(fallback));
    if (!(s > 0)) throw std::invalid_argument(std::string(name) + " must be > 0");
    return from_seconds(s);
  };
  o.init_timeout = seconds("RESILIENT_COMM_INIT_TIMEOUT_S", o.init_timeout);
  o.collective_timeout = seconds("RESILIENT_COMM_COLLECTIVE_TIMEOUT_S", o.collective_timeout);
  o.quiesce_timeout = seconds("RESILIENT_COMM_QUIESCE_TIMEOUT_S", o.quiesce_timeout);
  o.store_timeout = seconds("RESILIENT_COMM_STORE_TIMEOUT_S", o.store_timeout);
  int64_t poll_us =
      env_int("RESILIENT_COMM_POLL_INTERVAL_US",
              std::chrono::duration_cast<std::chrono::microseconds>(o.poll_interval).count());
  if (poll_us < 0) throw std::invalid_argument("RESILIENT_COMM_POLL_INTERVAL_US must be >= 0");
  o.poll_interval = std::chrono::microseconds(poll_us);
  if (auto mode = env_string("RESILIENT_COMM_REBUILD")) {
    auto parsed = parse_rebuild_mode(*mode);
    if (!parsed.ok()) {
      throw std::invalid_argument("RESILIENT_COMM_REBUILD: " + parsed.status().message());
    }
    o.rebuild_mode = *parsed;
  }
  o.revoke = env_feature("RESILIENT_COMM_REVOKE", o.revoke);
  if (auto name = env_string("RESILIENT_COMM_NAME")) o.name = *name;
  return o;
}

}  // namespace resilient::comm
