#include "resilient/comm/nccl_api.hpp"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstddef>
#include <sstream>

#include "resilient/common/logging.hpp"

#ifdef RESILIENT_HAVE_CUDA_HEADERS
#include <nccl.h>
// Our declarations must match the real header, or a call through the table corrupts memory.
static_assert(sizeof(ncclUniqueId) == sizeof(resilient::comm::NcclUniqueId));
static_assert(sizeof(ncclConfig_t) == sizeof(resilient::comm::NcclConfig));
static_assert(offsetof(ncclConfig_t, blocking) == offsetof(resilient::comm::NcclConfig, blocking));
static_assert(offsetof(ncclConfig_t, nvlinkCentricSched) ==
              offsetof(resilient::comm::NcclConfig, nvlink_centric_sched));
static_assert(ncclInProgress == resilient::comm::kNcclInProgress);
static_assert(ncclRemoteError == resilient::comm::kNcclRemoteError);
static_assert(NCCL_SHRINK_ABORT == resilient::comm::kNcclShrinkAbort);
static_assert(NCCL_CONFIG_UNDEF_INT == resilient::comm::kNcclConfigUndefInt);
static_assert(static_cast<int>(ncclFloat32) ==
              static_cast<int>(resilient::comm::NcclDataType::kFloat32));
static_assert(static_cast<int>(ncclBfloat16) ==
              static_cast<int>(resilient::comm::NcclDataType::kBfloat16));
static_assert(static_cast<int>(ncclAvg) == static_cast<int>(resilient::comm::NcclRedOp::kAvg));
#endif

namespace resilient::comm {
namespace {

constexpr unsigned int kConfigMagic = 0xcafebeef;
constexpr const char* kLibName = "libnccl.so.2";

bool is_directory(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

template <typename Fn>
void bind(void* handle, const char* name, Fn& slot) {
  slot = reinterpret_cast<Fn>(::dlsym(handle, name));
}

}  // namespace

std::string format_nccl_version(int code) {
  int major, minor, patch;
  if (code >= 10000) {
    major = code / 10000;
    minor = (code % 10000) / 100;
    patch = code % 100;
  } else {
    major = code / 1000;
    minor = (code % 1000) / 100;
    patch = code % 100;
  }
  std::ostringstream os;
  os << major << '.' << minor << '.' << patch;
  return os.str();
}

NcclConfig make_nccl_config(int runtime_version, bool blocking) {
  NcclConfig c{};
  c.size = sizeof(NcclConfig);
  c.magic = kConfigMagic;
  // NCCL reads the fields its own version knows, keyed on `version`; never claim a layout newer
  // than the library's or than ours.
  c.version = static_cast<unsigned int>(std::min(runtime_version, kNcclHeaderVersion));
  c.blocking = blocking ? 1 : 0;
  for (int* f : {&c.cga_cluster_size, &c.min_ctas, &c.max_ctas, &c.split_share, &c.traffic_class,
                 &c.collnet_enable, &c.cta_policy, &c.shrink_share, &c.nvls_ctas,
                 &c.n_channels_per_net_peer, &c.nvlink_centric_sched}) {
    *f = kNcclConfigUndefInt;
  }
  c.net_name = nullptr;
  c.comm_name = nullptr;
  return c;
}

int nccl_min_version(NcclFeature feature) {
  switch (feature) {
    case NcclFeature::kNonBlocking:
      return nccl_version_code(2, 14, 0);
    case NcclFeature::kShrink:
      return nccl_version_code(2, 27, 0);
    case NcclFeature::kRevoke:
      return nccl_version_code(2, 28, 7);
  }
  return 0;
}

const char* nccl_feature_name(NcclFeature feature) {
  switch (feature) {
    case NcclFeature::kNonBlocking:
      return "non-blocking communicators";
    case NcclFeature::kShrink:
      return "ncclCommShrink";
    case NcclFeature::kRevoke:
      return "ncclCommRevoke";
  }
  return "?";
}

Result<NcclLoadOptions> NcclLoadOptions::from_env() {
  NcclLoadOptions o;
  RESILIENT_ASSIGN_OR_RETURN(o.enabled, env_value("RESILIENT_NCCL", Feature::kAuto, parse_feature));
  if (auto p = env_string("RESILIENT_NCCL_PATH")) o.path = *p;
  RESILIENT_RETURN_IF_ERROR(o.validate());
  return o;
}

Status NcclLoadOptions::validate() const {
  if (enabled == Feature::kOn && path.empty() && !search_system) {
    return Status(StatusCode::kInvalidArgument,
                  "RESILIENT_NCCL=on with no path (RESILIENT_NCCL_PATH) and no system search");
  }
  return ok_status();
}

NcclLibrary::NcclLibrary(const NcclApi& api, int version, std::string origin, void* handle)
    : api_(api), version_(version), origin_(std::move(origin)), handle_(handle) {}

NcclLibrary::~NcclLibrary() {
  if (handle_ != nullptr) ::dlclose(handle_);
}

Result<std::shared_ptr<const NcclLibrary>> NcclLibrary::from_table(const NcclApi& api,
                                                                   std::string origin) {
  const std::pair<const char*, bool> required[] = {
      {"ncclGetVersion", api.get_version != nullptr},
      {"ncclGetUniqueId", api.get_unique_id != nullptr},
      {"ncclCommInitRankConfig", api.comm_init_rank_config != nullptr},
      {"ncclCommGetAsyncError", api.comm_get_async_error != nullptr},
      {"ncclCommAbort", api.comm_abort != nullptr},
      {"ncclCommFinalize", api.comm_finalize != nullptr},
      {"ncclCommDestroy", api.comm_destroy != nullptr},
      {"ncclCommCount", api.comm_count != nullptr},
      {"ncclCommUserRank", api.comm_user_rank != nullptr},
      {"ncclAllReduce", api.all_reduce != nullptr},
      {"ncclBroadcast", api.broadcast != nullptr},
      {"ncclGetErrorString", api.get_error_string != nullptr},
  };
  for (const auto& [name, present] : required) {
    if (!present) {
      return Status(StatusCode::kInvalidArgument,
                    std::string("NCCL table from ") + origin + " lacks " + name);
    }
  }
  int version = 0;
  int rc = api.get_version(&version);
  if (rc != kNcclSuccess) {
    return Status(StatusCode::kUnavailable,
                  "ncclGetVersion failed in " + origin + " (error " + std::to_string(rc) + ")");
  }
  if (version < nccl_min_version(NcclFeature::kNonBlocking)) {
    return Status(StatusCode::kUnavailable,
                  "NCCL " + format_nccl_version(version) + " from " + origin +
                      " is too old: resilient needs >= 2.14.0 (non-blocking communicators)");
  }
  return std::shared_ptr<const NcclLibrary>(
      new NcclLibrary(api, version, std::move(origin), nullptr));
}

Result<std::shared_ptr<const NcclLibrary>> NcclLibrary::load(const NcclLoadOptions& options) {
  if (options.enabled == Feature::kOff) {
    return Status(StatusCode::kUnavailable, "NCCL disabled by RESILIENT_NCCL=off");
  }
  std::vector<std::string> candidates;
  if (!options.path.empty()) {
    candidates.push_back(is_directory(options.path) ? options.path + "/" + kLibName : options.path);
  }
  if (options.search_system) candidates.emplace_back(kLibName);
  std::string attempts;
  for (const auto& file : candidates) {
    // RTLD_NODELETE: NCCL keeps process-wide threads (proxy, RAS) that outlive every
    // communicator, so it must never be unmapped, even when the last NcclLibrary goes away.
    void* handle = ::dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (handle == nullptr) {
      const char* err = ::dlerror();
      attempts += "\n  " + file + ": " + (err ? err : "dlopen failed");
      continue;
    }
    NcclApi api;
    bind(handle, "ncclGetVersion", api.get_version);
    bind(handle, "ncclGetUniqueId", api.get_unique_id);
    bind(handle, "ncclCommInitRankConfig", api.comm_init_rank_config);
    bind(handle, "ncclCommGetAsyncError", api.comm_get_async_error);
    bind(handle, "ncclCommAbort", api.comm_abort);
    bind(handle, "ncclCommFinalize", api.comm_finalize);
    bind(handle, "ncclCommDestroy", api.comm_destroy);
    bind(handle, "ncclCommCount", api.comm_count);
    bind(handle, "ncclCommUserRank", api.comm_user_rank);
    bind(handle, "ncclAllReduce", api.all_reduce);
    bind(handle, "ncclBroadcast", api.broadcast);
    bind(handle, "ncclGetErrorString", api.get_error_string);
    bind(handle, "ncclGetLastError", api.get_last_error);
    bind(handle, "ncclCommRevoke", api.comm_revoke);
    bind(handle, "ncclCommShrink", api.comm_shrink);
    Dl_info info{};
    std::string origin = file;
    if (api.get_version != nullptr &&
        ::dladdr(reinterpret_cast<void*>(api.get_version), &info) != 0 && info.dli_fname) {
      origin = info.dli_fname;
    }
    auto lib = from_table(api, origin);
    if (!lib.ok()) {
      ::dlclose(handle);
      attempts += "\n  " + file + ": " + lib.status().message();
      continue;
    }
    // Hand the handle to the library object so it is closed with it.
    auto owned =
        std::shared_ptr<const NcclLibrary>(new NcclLibrary(api, (*lib)->version(), origin, handle));
    RESILIENT_LOG(
        kInfo, "comm: loaded NCCL " << format_nccl_version(owned->version()) << " from " << origin);
    return owned;
  }
  return Status(StatusCode::kUnavailable,
                "cannot load NCCL (set RESILIENT_NCCL_PATH to "
                "torch's nvidia/nccl/lib):" +
                    attempts);
}

bool NcclLibrary::supports(NcclFeature feature) const {
  if (version_ < nccl_min_version(feature)) return false;
  switch (feature) {
    case NcclFeature::kNonBlocking:
      return true;
    case NcclFeature::kShrink:
      return api_.comm_shrink != nullptr;
    case NcclFeature::kRevoke:
      return api_.comm_revoke != nullptr;
  }
  return false;
}

Status NcclLibrary::require(NcclFeature feature) const {
  if (supports(feature)) return ok_status();
  std::string why = version_ < nccl_min_version(feature)
                        ? "needs NCCL >= " + format_nccl_version(nccl_min_version(feature))
                        : std::string("the symbol is missing");
  return Status(StatusCode::kUnavailable, std::string(nccl_feature_name(feature)) +
                                              " unavailable: " + why + "; loaded NCCL " +
                                              format_nccl_version(version_) + " from " + origin_);
}

std::string NcclLibrary::describe(int result, NcclComm comm) const {
  std::string text = api_.get_error_string ? api_.get_error_string(result) : "";
  if (text.empty()) text = "NCCL error " + std::to_string(result);
  if (comm != nullptr && api_.get_last_error != nullptr) {
    const char* last = api_.get_last_error(comm);
    if (last != nullptr && *last != '\0') text += ": " + std::string(last);
  }
  return text;
}

}  // namespace resilient::comm
