#include "resilient/checkpoint/format.hpp"

#include <xxhash.h>

#include <cinttypes>
#include <cstdio>
#include <limits>
#include <map>
#include <string_view>
#include <unordered_set>

namespace resilient::checkpoint {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxTensors = 50'000'000;
constexpr uint64_t kMaxDims = 64;
constexpr uint64_t kMaxShards = 10'000'000;
constexpr uint64_t kMaxChunkBytes = 1ull << 32;
constexpr uint64_t kMaxTensorBytes = 1ull << 50;

Status corrupt(const std::string& origin, const std::string& what) {
  Status s(StatusCode::kCorrupt, "invalid manifest: " + what);
  s.with_path(origin);
  return s;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

bool parse_hex64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    v = v << 4 | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

constexpr std::string_view kSealPrefix = "{\"manifest_xxh3\":\"";
constexpr size_t kSealEnd = kSealPrefix.size() + 16;  // the digits, then `",` or `"}`
constexpr int kMaxDepth = 512;

// XXH3-64 of `text` with the seal's 16 digits read as '0's.
uint64_t seal_hash(std::string text) {
  text.replace(kSealPrefix.size(), 16, 16, '0');
  return XXH3_64bits(text.data(), text.size());
}

bool has_seal(const std::string& text) {
  return text.size() > kSealEnd + 1 &&
         std::string_view(text).substr(0, kSealPrefix.size()) == kSealPrefix &&
         text[kSealEnd] == '"' && (text[kSealEnd + 1] == ',' || text[kSealEnd + 1] == '}');
}

// The deepest nesting of objects and arrays in a JSON text (strings skipped), so that a hostile
// text cannot exhaust the recursive parser's stack; stops counting past `limit`.
int json_depth(const std::string& text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"')
      in_string = true;
    else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == '}' || c == ']')
      --depth;
  }
  return deepest;
}

// A shard file name must be a plain name: no separators, no "." or "..", no NUL, not hidden.
bool safe_file_name(const std::string& name) {
  if (name.empty() || name.size() > 255 || name[0] == '.') return false;
  for (char c : name) {
    if (c == '/' || c == '\\' || c == '\0') return false;
  }
  return true;
}

// Typed field readers that turn a wrong type into a Corrupt status instead of an exception.
template <typename T>
bool get_to(const json& j, const char* key, T* out) {
  auto it = j.find(key);
  if (it == j.end()) return false;
  if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) return false;
  } else if constexpr (std::is_unsigned_v<T>) {
    if (!it->is_number_unsigned()) return false;
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer()) return false;
  }
  *out = it->get<T>();
  return true;
}

bool get_int_list(const json& j, const char* key, std::vector<int64_t>* out, bool optional) {
  auto it = j.find(key);
  if (it == j.end()) return optional;
  if (!it->is_array() || it->size() > kMaxDims) return false;
  out->clear();
  for (const auto& v : *it) {
    if (!v.is_number_integer()) return false;
    int64_t x = v.get<int64_t>();
    if (x < 0) return false;
    out->push_back(x);
  }
  return true;
}

}  // namespace

uint64_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, uint64_t> sizes = {
      {"float64", 8},     {"float32", 4},         {"float16", 2},         {"bfloat16", 2},
      {"int64", 8},       {"int32", 4},           {"int16", 2},           {"int8", 1},
      {"uint8", 1},       {"uint16", 2},          {"uint32", 4},          {"uint64", 8},
      {"bool", 1},        {"complex64", 8},       {"complex128", 16},     {"float8_e4m3fn", 1},
      {"float8_e5m2", 1}, {"float8_e4m3fnuz", 1}, {"float8_e5m2fnuz", 1}, {"complex32", 4}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

const char* codec_name(Codec c) { return c == Codec::kZstd ? "zstd" : "none"; }

std::string shard_file_name(int rank, int part) {
  char buf[48];
  if (part == 0) {
    std::snprintf(buf, sizeof buf, "rank-%05d.data", rank);
  } else {
    std::snprintf(buf, sizeof buf, "rank-%05d.%d.data", rank, part);
  }
  return buf;
}

std::string step_dir_name(int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%012" PRId64, step);
  return buf;
}

int64_t parse_step_dir_name(const std::string& name) {
  // 12 digits, more only for steps of 10^12 and above (what step_dir_name writes: no leading
  // zeros beyond the 12), so every step has exactly one name.
  if (name.size() < 17 || name.size() > 24 || name.rfind("step-", 0) != 0) return -1;
  if (name.size() > 17 && name[5] == '0') return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    const int d = name[i] - '0';
    if (v > (std::numeric_limits<int64_t>::max() - d) / 10) return -1;
    v = v * 10 + d;
  }
  return v;
}

std::string to_json(const Manifest& m) {
  json j;
  j["format"] = kFormatName;
  j["version"] = m.version;
  j["step"] = m.step;
  j["world_size"] = m.world_size;
  json shards = json::array();
  for (const auto& s : m.shards)
    shards.push_back({{"rank", s.rank}, {"file", s.file}, {"bytes", s.bytes}});
  j["shards"] = std::move(shards);
  json tensors = json::array();
  for (const auto& t : m.tensors) {
    json chunks = json::array();
    for (const auto& c : t.chunks) {
      json cj = {{"off", c.offset}, {"len", c.len}, {"raw", c.raw}, {"xxh3", hex64(c.xxh3)}};
      if (c.codec != Codec::kNone) cj["codec"] = codec_name(c.codec);
      chunks.push_back(std::move(cj));
    }
    json tj = {{"name", t.name},     {"dtype", t.dtype}, {"shape", t.shape},
               {"nbytes", t.nbytes}, {"shard", t.shard}, {"chunks", std::move(chunks)}};
    if (!t.global_shape.empty()) {
      tj["global_shape"] = t.global_shape;
      tj["global_offset"] = t.global_offset;
    }
    tensors.push_back(std::move(tj));
  }
  j["tensors"] = std::move(tensors);
  j["values"] = m.values;
  j["meta"] = m.meta;
  return seal_manifest(j.dump()).value();
}

Result<std::string> seal_manifest(const std::string& text) {
  if (text.empty() || text[0] != '{')
    return Status(StatusCode::kInvalidArgument, "a manifest is a JSON object");
  std::string rest = has_seal(text) ? text.substr(kSealEnd + 1) : text.substr(1);
  if (!rest.empty() && rest[0] == ',') rest.erase(0, 1);
  const bool empty_object = rest == "}";
  std::string out =
      std::string(kSealPrefix) + std::string(16, '0') + (empty_object ? "\"" : "\",") + rest;
  const std::string digits = hex64(seal_hash(out));
  out.replace(kSealPrefix.size(), 16, digits);
  return out;
}

Result<Manifest> parse_manifest(const std::string& text, const std::string& origin) {
  if (text.size() > kMaxManifestBytes) return corrupt(origin, "manifest larger than 1 GiB");
  const bool sealed = has_seal(text);
  if (sealed) {
    uint64_t stored = 0;
    if (!parse_hex64(text.substr(kSealPrefix.size(), 16), &stored) || stored != seal_hash(text)) {
      return corrupt(origin, "manifest checksum mismatch (the file was altered or damaged)");
    }
  }
  if (json_depth(text, kMaxDepth) > kMaxDepth) {
    return corrupt(origin, "nested deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return corrupt(origin, "not valid JSON (truncated or corrupt)");
  if (!j.is_object()) return corrupt(origin, "top level is not an object");
  std::string format;
  if (!get_to(j, "format", &format) || format != kFormatName) {
    return corrupt(origin, "not a resilient checkpoint manifest (format field)");
  }
  Manifest m;
  if (!get_to(j, "version", &m.version)) return corrupt(origin, "missing version");
  if (m.version < kOldestFormatVersion || m.version > kFormatVersion) {
    Status s(StatusCode::kVersionMismatch, "checkpoint format version " +
                                               std::to_string(m.version) +
                                               " is not supported (this build reads version " +
                                               std::to_string(kFormatVersion) + ")");
    s.with_path(origin);
    return s;
  }
  if (m.version >= 2 && !sealed)
    return corrupt(origin, "manifest seal missing (version 2 manifests are sealed)");
  if (!get_to(j, "step", &m.step) || m.step < 0) return corrupt(origin, "missing or negative step");
  if (!get_to(j, "world_size", &m.world_size) || m.world_size < 1)
    return corrupt(origin, "bad world_size");

  auto shards = j.find("shards");
  if (shards == j.end() || !shards->is_array() || shards->empty() || shards->size() > kMaxShards) {
    return corrupt(origin, "bad shards list");
  }
  for (const auto& sj : *shards) {
    ShardEntry s;
    if (!sj.is_object() || !get_to(sj, "rank", &s.rank) || !get_to(sj, "file", &s.file) ||
        !get_to(sj, "bytes", &s.bytes)) {
      return corrupt(origin, "bad shard entry");
    }
    if (!safe_file_name(s.file))
      return corrupt(origin, "shard file name escapes the checkpoint directory: '" + s.file + "'");
    if (s.rank < 0) return corrupt(origin, "negative shard rank");
    m.shards.push_back(std::move(s));
  }

  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_array() || tensors->size() > kMaxTensors) {
    return corrupt(origin, "bad tensors list");
  }
  m.tensors.reserve(tensors->size());
  std::unordered_set<std::string> names;
  for (const auto& tj : *tensors) {
    TensorEntry t;
    if (!tj.is_object() || !get_to(tj, "name", &t.name) || !get_to(tj, "dtype", &t.dtype) ||
        !get_to(tj, "nbytes", &t.nbytes) || !get_to(tj, "shard", &t.shard) ||
        !get_int_list(tj, "shape", &t.shape, false) ||
        !get_int_list(tj, "global_shape", &t.global_shape, true) ||
        !get_int_list(tj, "global_offset", &t.global_offset, true)) {
      return corrupt(origin,
                     "bad tensor entry" + (t.name.empty() ? std::string() : " '" + t.name + "'"));
    }
    const std::string what = "tensor '" + t.name + "': ";
    uint64_t esize = dtype_size(t.dtype);
    if (esize == 0) return corrupt(origin, what + "unknown dtype '" + t.dtype + "'");
    if (t.shard >= m.shards.size()) return corrupt(origin, what + "shard index out of range");
    if (t.global_shape.size() != t.global_offset.size() ||
        (!t.global_shape.empty() && t.global_shape.size() != t.shape.size())) {
      return corrupt(origin, what + "global_shape/global_offset do not match shape");
    }
    for (size_t d = 0; d < t.global_shape.size(); ++d) {
      if (t.global_offset[d] + t.shape[d] > t.global_shape[d])
        return corrupt(origin, what + "slice outside global shape");
    }
    // numel with overflow checks
    uint64_t numel = 1;
    for (int64_t dim : t.shape) {
      if (dim != 0 && numel > kMaxTensorBytes / static_cast<uint64_t>(dim))
        return corrupt(origin, what + "absurd shape");
      numel *= static_cast<uint64_t>(dim);
    }
    if (numel > kMaxTensorBytes / esize || numel * esize != t.nbytes) {
      return corrupt(origin, what + "nbytes does not match shape and dtype");
    }
    auto chunks = tj.find("chunks");
    if (chunks == tj.end() || !chunks->is_array() || chunks->size() > t.nbytes / 1 + 1) {
      return corrupt(origin, what + "bad chunks list");
    }
    uint64_t raw_total = 0;
    for (const auto& cj : *chunks) {
      Chunk c;
      std::string hash, codec = "none";
      if (!cj.is_object() || !get_to(cj, "off", &c.offset) || !get_to(cj, "len", &c.len) ||
          !get_to(cj, "raw", &c.raw) || !get_to(cj, "xxh3", &hash) || !parse_hex64(hash, &c.xxh3)) {
        return corrupt(origin, what + "bad chunk entry");
      }
      if (cj.contains("codec") && !get_to(cj, "codec", &codec))
        return corrupt(origin, what + "bad codec");
      if (codec == "zstd")
        c.codec = Codec::kZstd;
      else if (codec != "none")
        return corrupt(origin, what + "unknown codec '" + codec + "'");
      if (c.len > kMaxChunkBytes || c.raw > kMaxChunkBytes || c.raw == 0 ||
          (c.codec == Codec::kNone && c.len != c.raw) || c.offset > kMaxTensorBytes) {
        return corrupt(origin, what + "absurd chunk size or offset");
      }
      raw_total += c.raw;
      if (raw_total > t.nbytes) return corrupt(origin, what + "chunks larger than the tensor");
      t.chunks.push_back(c);
    }
    if (raw_total != t.nbytes) return corrupt(origin, what + "chunks do not cover the tensor");
    if (!names.insert(t.name).second)
      return corrupt(origin, "tensor '" + t.name + "' is listed twice");
    m.tensors.push_back(std::move(t));
  }
  if (auto v = j.find("values"); v != j.end()) m.values = *v;
  if (auto v = j.find("meta"); v != j.end() && v->is_object()) m.meta = *v;
  return m;
}

Status check_extents(const Manifest& m, const std::vector<uint64_t>& file_sizes) {
  for (const auto& t : m.tensors) {
    uint64_t size = file_sizes.at(t.shard);
    for (const auto& c : t.chunks) {
      if (c.offset + c.len > size) {
        Status s(StatusCode::kCorrupt,
                 "tensor '" + t.name + "' extends past the end of its data file (truncated)");
        s.with_path(m.shards[t.shard].file).with_offset(c.offset);
        return s;
      }
    }
  }
  return ok_status();
}

}  // namespace resilient::checkpoint
