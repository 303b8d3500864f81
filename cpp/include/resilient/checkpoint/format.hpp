#pragma once
// The on-disk checkpoint format (docs/FORMAT.md): one directory per step holding one data file per
// rank and a JSON manifest that lists every tensor's chunks with their checksums. Parsing
// validates everything a hostile or corrupt manifest could get wrong.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "resilient/common/status.hpp"

namespace resilient::checkpoint {

/// Version 2 manifests are sealed (seal_manifest); version 1 (unsealed) is still read.
inline constexpr int kFormatVersion = 2;
inline constexpr int kOldestFormatVersion = 1;
inline constexpr const char* kFormatName = "resilient-checkpoint";
inline constexpr const char* kManifestName = "manifest.json";
inline constexpr uint64_t kMaxManifestBytes = 1ull << 30;

/// Bytes per element of a dtype name ("float32", "bfloat16", ...); 0 if unknown.
uint64_t dtype_size(const std::string& dtype);

enum class Codec { kNone, kZstd };
const char* codec_name(Codec c);

/// One stored chunk of a tensor: `len` bytes at `offset` of the shard file, which decode to
/// `raw` bytes. Chunks of a tensor are stored in order and decode to consecutive bytes.
struct Chunk {
  uint64_t offset = 0;
  uint64_t len = 0;
  uint64_t raw = 0;
  uint64_t xxh3 = 0;  // XXH3_64bits of the stored bytes
  Codec codec = Codec::kNone;
};

struct TensorEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  uint32_t shard = 0;  // index into Manifest::shards
  std::vector<Chunk> chunks;
  // A slice of a larger (global) tensor, for sharded models: empty when the tensor is whole.
  std::vector<int64_t> global_shape;
  std::vector<int64_t> global_offset;
};

struct ShardEntry {
  int rank = 0;
  std::string file;    // a plain file name inside the step directory
  uint64_t bytes = 0;  // the data file's size
};

struct Manifest {
  int version = kFormatVersion;
  int64_t step = 0;
  int world_size = 1;
  std::vector<ShardEntry> shards;
  std::vector<TensorEntry> tensors;
  nlohmann::json values = nlohmann::json::object();  // non-tensor state, opaque to the core
  nlohmann::json meta = nlohmann::json::object();    // free-form: timings, host, library version
};

/// The manifest's JSON text, sealed (seal_manifest).
std::string to_json(const Manifest& m);
/// Seals a manifest's JSON text: `{"manifest_xxh3":"<16 hex>",` followed by the rest of the
/// object, where the hex digits are XXH3-64 of the whole text with those digits as '0's. An
/// existing seal is replaced (tools that edit a manifest by hand reseal it). Every byte a reader
/// trusts is covered, and the check runs before the text is parsed. Errors: kInvalidArgument
/// when `text` does not start with '{'.
Result<std::string> seal_manifest(const std::string& text);
/// Parses and validates: the seal (kCorrupt when it does not match, or when a version 2
/// manifest has none), nesting depth (at most 512), format name and version (kVersionMismatch),
/// field types, counts and sizes (kCorrupt), file names that could escape the directory
/// (kCorrupt), nbytes equal to shape x dtype size and to the sum of chunk raw sizes. `origin`
/// names the file in errors.
Result<Manifest> parse_manifest(const std::string& text, const std::string& origin);
/// Checks chunk extents against the real shard file sizes (truncation) — kCorrupt naming the file.
Status check_extents(const Manifest& m, const std::vector<uint64_t>& file_sizes);

/// Shard file name for a rank: "rank-00003.data"; its further data files (files_per_rank > 1)
/// "rank-00003.1.data", "rank-00003.2.data"...
std::string shard_file_name(int rank, int part = 0);
/// Directory name for a step: "step-000000000042".
std::string step_dir_name(int64_t step);
/// Parses a step directory name; -1 if it is not one.
int64_t parse_step_dir_name(const std::string& name);

}  // namespace resilient::checkpoint
