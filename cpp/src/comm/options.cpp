#include "resilient/comm/options.hpp"

#include <string>
#include <tuple>

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

Result<CommOptions> CommOptions::from_env() {
  CommOptions o;
  auto seconds = [](const char* name, Duration* field) -> Status {
    RESILIENT_ASSIGN_OR_RETURN(double s, env_value(name, to_seconds(*field), parse_double));
    *field = from_seconds(s);
    return ok_status();
  };
  RESILIENT_RETURN_IF_ERROR(seconds("RESILIENT_COMM_INIT_TIMEOUT_S", &o.init_timeout));
  RESILIENT_RETURN_IF_ERROR(seconds("RESILIENT_COMM_COLLECTIVE_TIMEOUT_S", &o.collective_timeout));
  RESILIENT_RETURN_IF_ERROR(seconds("RESILIENT_COMM_QUIESCE_TIMEOUT_S", &o.quiesce_timeout));
  RESILIENT_RETURN_IF_ERROR(seconds("RESILIENT_COMM_STORE_TIMEOUT_S", &o.store_timeout));
  RESILIENT_ASSIGN_OR_RETURN(
      int64_t poll_us,
      env_value<int64_t>(
          "RESILIENT_COMM_POLL_INTERVAL_US",
          std::chrono::duration_cast<std::chrono::microseconds>(o.poll_interval).count(),
          parse_int));
  o.poll_interval = std::chrono::microseconds(poll_us);
  RESILIENT_ASSIGN_OR_RETURN(
      o.rebuild_mode, env_value("RESILIENT_COMM_REBUILD", o.rebuild_mode, parse_rebuild_mode));
  RESILIENT_ASSIGN_OR_RETURN(o.revoke, env_value("RESILIENT_COMM_REVOKE", o.revoke, parse_feature));
  if (auto name = env_string("RESILIENT_COMM_NAME")) o.name = *name;
  RESILIENT_RETURN_IF_ERROR(o.validate());
  return o;
}

Status CommOptions::validate() const {
  auto invalid = [](const std::string& what) {
    return Status(StatusCode::kInvalidArgument, "comm options: " + what);
  };
  for (auto [field, value, variable] :
       {std::tuple{"init_timeout", init_timeout, "RESILIENT_COMM_INIT_TIMEOUT_S"},
        std::tuple{"collective_timeout", collective_timeout, "RESILIENT_COMM_COLLECTIVE_TIMEOUT_S"},
        std::tuple{"quiesce_timeout", quiesce_timeout, "RESILIENT_COMM_QUIESCE_TIMEOUT_S"},
        std::tuple{"store_timeout", store_timeout, "RESILIENT_COMM_STORE_TIMEOUT_S"}}) {
    if (value <= Duration::zero()) {
      return invalid(std::string(field) + " (" + variable + ") must be > 0");
    }
  }
  if (poll_interval < Duration::zero()) {
    return invalid("poll_interval (RESILIENT_COMM_POLL_INTERVAL_US) must be >= 0");
  }
  if (name.empty()) return invalid("name (RESILIENT_COMM_NAME) must not be empty");
  return ok_status();
}

}  // namespace resilient::comm
