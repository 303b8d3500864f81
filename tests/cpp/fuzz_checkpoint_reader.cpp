// libFuzzer target for the reader: a real checkpoint is written once; each input then replaces
// either its manifest or its data file, and a full restore must end in OK or an error Status
// (Corrupt, NotFound, ...), never a crash, an out-of-bounds access or a silent wrong tensor.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "resilient/checkpoint/checkpointer.hpp"
#include "resilient/checkpoint/commit.hpp"
#include "resilient/checkpoint/restore.hpp"

namespace {

namespace fs = std::filesystem;
using namespace resilient;
using namespace resilient::checkpoint;

struct Fixture {
  fs::path root;
  std::string manifest_text;
  std::string data;
  std::vector<float> original;
  std::unique_ptr<memory::HostPool> pool;

  Fixture() {
    root = fs::temp_directory_path() / ("resilient-fuzz-" + std::to_string(::getpid()));
    fs::remove_all(root);
    auto o = CheckpointOptions::from_env(root.string()).value();
    o.chunk_bytes = 4096;
    o.pool.slab_bytes = 16384;
    o.pool.budget_bytes = 1 << 20;
    o.zstd_level = 1;
    o.io.direct = Feature::kOff;
    auto c = Checkpointer::create(o);
    original.resize(5000);
    for (size_t i = 0; i < original.size(); ++i) original[i] = static_cast<float>(i % 97);
    std::vector<TensorSpec> specs = {{"w", "float32", {5000}, original.data(), original.size() * 4},
                                     {"b", "float32", {3}, original.data(), 12}};
    auto h = (*c)->save(1, specs, {{"k", 1}});
    if (!h.ok() || !(*h)->wait(std::chrono::seconds(30)).ok()) __builtin_trap();
    const fs::path dir = step_dir_path(root.string(), 1);
    manifest_text = slurp(dir / kManifestName);
    data = slurp(dir / shard_file_name(0));
    memory::PoolOptions po;
    po.slab_bytes = 16384;
    po.budget_bytes = 1 << 20;
    po.pin = Feature::kOff;
    pool = std::make_unique<memory::HostPool>(po);
  }
  ~Fixture() {  // libFuzzer exits through exit() at -max_total_time, which runs this
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  static std::string slurp(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  static void spit(const fs::path& p, const std::string& s) {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(s.data(), static_cast<std::streamsize>(s.size()));
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  static Fixture fx;
  if (size == 0) return 0;
  const bool replace_manifest = bytes[0] & 1;
  std::string input(reinterpret_cast<const char*>(bytes + 1), size - 1);
  const fs::path dir = step_dir_path(fx.root.string(), 1);
  Fixture::spit(dir / kManifestName, replace_manifest ? input : fx.manifest_text);
  Fixture::spit(dir / shard_file_name(0), replace_manifest ? fx.data : input);

  auto m = read_manifest(fx.root.string(), 1);
  if (!m.ok()) return 0;
  RestoreOptions ro;
  ro.threads = 2;
  ro.io.direct = Feature::kOff;
  ro.timeout = std::chrono::seconds(10);
  // Restore every tensor the manifest lists into buffers of the size it claims (bounded).
  std::vector<std::vector<char>> bufs;
  std::vector<ReadTarget> targets;
  uint64_t total = 0;
  for (const auto& t : m->tensors) {
    total += t.nbytes;
    if (total > (64u << 20)) return 0;
    bufs.emplace_back(t.nbytes);
    targets.push_back(ReadTarget{t.name, bufs.back().data(), t.nbytes});
  }
  Status s = restore_tensors(dir.string(), *m, targets, ro, *fx.pool);
  // With the original manifest, success means the data file is byte-identical where it matters.
  if (s.ok() && !replace_manifest) {
    if (std::memcmp(bufs[0].data(), fx.original.data(), bufs[0].size()) != 0) __builtin_trap();
  }
  return 0;
}
