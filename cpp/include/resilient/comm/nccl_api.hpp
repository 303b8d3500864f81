#pragma once
// NCCL loaded at run time. The library is opened with dlopen (no link-time NCCL dependency), so
// resilient loads on machines without NCCL and uses the NCCL that PyTorch ships. The types below
// mirror nccl.h (NCCL 2.28 layout); src/comm/nccl_api.cpp checks them against the real header
// when it is available at build time (RESILIENT_HAVE_CUDA_HEADERS).

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "resilient/common/config.hpp"
#include "resilient/common/status.hpp"

struct ncclComm;  // NCCL's opaque communicator; compatible with nccl.h's ncclComm_t.

namespace resilient::comm {

/// ncclResult_t values.
enum NcclResultCode : int {
  kNcclSuccess = 0,
  kNcclUnhandledCudaError = 1,
  kNcclSystemError = 2,
  kNcclInternalError = 3,
  kNcclInvalidArgument = 4,
  kNcclInvalidUsage = 5,
  kNcclRemoteError = 6,
  kNcclInProgress = 7,
};

/// ncclDataType_t values used by resilient.
enum class NcclDataType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9
};
/// ncclRedOp_t built-in values.
enum class NcclRedOp : int { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };

using NcclComm = ncclComm*;

/// ncclUniqueId: 128 opaque bytes produced by rank 0 and shared with every rank.
struct NcclUniqueId {
  char internal[128];
};

/// ncclConfig_t (NCCL 2.28 layout). Build one with make_nccl_config().
struct NcclConfig {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cga_cluster_size;
  int min_ctas;
  int max_ctas;
  const char* net_name;
  int split_share;
  int traffic_class;
  const char* comm_name;
  int collnet_enable;
  int cta_policy;
  int shrink_share;
  int nvls_ctas;
  int n_channels_per_net_peer;
  int nvlink_centric_sched;
};

/// NCCL_CONFIG_UNDEF_INT.
inline constexpr int kNcclConfigUndefInt = static_cast<int>(0x80000000u);
inline constexpr int kNcclShrinkDefault = 0;  ///< NCCL_SHRINK_DEFAULT
inline constexpr int kNcclShrinkAbort = 1;    ///< NCCL_SHRINK_ABORT

/// NCCL_VERSION(x, y, z): the code ncclGetVersion reports.
constexpr int nccl_version_code(int major, int minor, int patch) {
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch
                                    : major * 10000 + minor * 100 + patch;
}
/// "2.28.9" for 22809.
std::string format_nccl_version(int code);

/// The NCCL layout this build declares (and, with CUDA headers, checked against).
inline constexpr int kNcclHeaderVersion = nccl_version_code(2, 28, 9);

/// A config with every attribute undefined except `blocking`; `runtime_version` is the loaded
/// library's version (the struct's version field is never newer than the library).
NcclConfig make_nccl_config(int runtime_version, bool blocking);

/// The NCCL entry points resilient uses. Optional entries (revoke, shrink, get_last_error) are
/// null when the library lacks them. Tests inject a fake table instead of dlopen.
struct NcclApi {
  int (*get_version)(int* version) = nullptr;
  int (*get_unique_id)(NcclUniqueId* id) = nullptr;
  int (*comm_init_rank_config)(NcclComm* comm, int nranks, NcclUniqueId id, int rank,
                               NcclConfig* config) = nullptr;
  int (*comm_get_async_error)(NcclComm comm, int* async_error) = nullptr;
  int (*comm_abort)(NcclComm comm) = nullptr;
  int (*comm_finalize)(NcclComm comm) = nullptr;
  int (*comm_destroy)(NcclComm comm) = nullptr;
  int (*comm_count)(NcclComm comm, int* count) = nullptr;
  int (*comm_user_rank)(NcclComm comm, int* rank) = nullptr;
  int (*all_reduce)(const void* send, void* recv, size_t count, int datatype, int op, NcclComm comm,
                    void* stream) = nullptr;
  int (*broadcast)(const void* send, void* recv, size_t count, int datatype, int root,
                   NcclComm comm, void* stream) = nullptr;
  const char* (*get_error_string)(int result) = nullptr;
  // Optional.
  const char* (*get_last_error)(NcclComm comm) = nullptr;
  int (*comm_revoke)(NcclComm comm, int flags) = nullptr;  // NCCL >= 2.28.7
  int (*comm_shrink)(NcclComm comm, int* exclude, int exclude_count, NcclComm* newcomm,
                     NcclConfig* config, int flags) = nullptr;  // NCCL >= 2.27.0
};

/// Optional NCCL features, each gated on the runtime version and on the symbol being present.
enum class NcclFeature { kNonBlocking, kShrink, kRevoke };
/// The first NCCL version that has `feature`.
int nccl_min_version(NcclFeature feature);
const char* nccl_feature_name(NcclFeature feature);

/// Where and whether to load NCCL.
struct NcclLoadOptions {
  /// A file (libnccl.so.2) or a directory holding it, tried first (e.g. torch's
  /// site-packages/nvidia/nccl/lib). Empty: not used.
  std::string path;
  /// Also try the dynamic loader's search for libnccl.so.2 (LD_LIBRARY_PATH, ld.so.cache).
  bool search_system = true;
  /// RESILIENT_NCCL: AUTO/ON/OFF. OFF makes load() return Unavailable.
  Feature enabled = Feature::kAuto;
  /// Reads RESILIENT_NCCL and RESILIENT_NCCL_PATH, then validate()s.
  static Result<NcclLoadOptions> from_env();
  /// kInvalidArgument when ON leaves no place to look (no path, no system search).
  Status validate() const;
};

/// A loaded NCCL (or an injected fake): the function table and the runtime version.
/// Immutable after construction; thread-safe. Communicators must not outlive it (CommManager
/// holds a shared_ptr). The library itself stays mapped for the rest of the process
/// (RTLD_NODELETE): NCCL's own threads outlive communicators.
class NcclLibrary {
 public:
  /// Opens NCCL: options.path (file, or directory + "/libnccl.so.2"), then the dynamic loader's
  /// search for libnccl.so.2. Errors: Unavailable (disabled, not found, missing required
  /// symbol, or older than 2.14 which lacks non-blocking communicators), listing every attempt.
  static Result<std::shared_ptr<const NcclLibrary>> load(const NcclLoadOptions& options);
  /// Wraps an injected table (tests). `version` is what the table's get_version should report;
  /// errors: InvalidArgument when a required entry is null.
  static Result<std::shared_ptr<const NcclLibrary>> from_table(const NcclApi& api,
                                                               std::string origin = "injected");
  ~NcclLibrary();
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  const NcclApi& api() const { return api_; }
  int version() const { return version_; }
  /// The file it was loaded from ("injected" for a fake table).
  const std::string& origin() const { return origin_; }
  /// True when the runtime version and the table both provide `feature`.
  bool supports(NcclFeature feature) const;
  /// OK, or Unavailable naming the feature, the version needed and the version loaded.
  Status require(NcclFeature feature) const;
  /// "ncclRemoteError: <last error of comm>" for an error code.
  std::string describe(int result, NcclComm comm = nullptr) const;

 private:
  NcclLibrary(const NcclApi& api, int version, std::string origin, void* handle);
  NcclApi api_;
  int version_;
  std::string origin_;
  void* handle_;
};

}  // namespace resilient::comm
