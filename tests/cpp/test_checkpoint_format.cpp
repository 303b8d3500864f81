#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "resilient/checkpoint/format.hpp"
#include "resilient/checkpoint/snapshot.hpp"
#include "resilient/io/file.hpp"

namespace resilient::checkpoint {
namespace {

Manifest sample() {
  Manifest m;
  m.step = 42;
  m.shards.push_back(ShardEntry{0, "rank-00000.data", 8192});
  TensorEntry t;
  t.name = "model/w";
  t.dtype = "float32";
  t.shape = {2, 3};
  t.nbytes = 24;
  t.chunks.push_back(Chunk{0, 24, 24, 0xdeadbeefcafef00dull, Codec::kNone});
  m.tensors.push_back(t);
  TensorEntry e;  // empty tensor: no chunks
  e.name = "empty";
  e.dtype = "bfloat16";
  e.shape = {0, 5};
  m.tensors.push_back(e);
  m.values = {{"lr", 0.1}};
  return m;
}

// Parses `text` resealed, so that each test reaches the check it is about (the seal has its own).
StatusCode parse_code(const std::string& text) {
  auto sealed = seal_manifest(text);
  return parse_manifest(sealed.ok() ? *sealed : text, "m.json").status().code();
}

nlohmann::json sample_json() {
  auto j = nlohmann::json::parse(to_json(sample()));
  j.erase("manifest_xxh3");
  return j;
}

TEST(Format, RoundTrips) {
  auto m = parse_manifest(to_json(sample()), "m.json");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->step, 42);
  ASSERT_EQ(m->tensors.size(), 2u);
  EXPECT_EQ(m->tensors[0].chunks[0].xxh3, 0xdeadbeefcafef00dull);
  EXPECT_EQ(m->tensors[1].nbytes, 0u);
  EXPECT_EQ(m->values["lr"], 0.1);
}

TEST(Format, RejectsGarbageAndTruncation) {
  EXPECT_EQ(parse_code(""), StatusCode::kCorrupt);
  EXPECT_EQ(parse_code("{\"format\": 1"), StatusCode::kCorrupt);
  std::string full = to_json(sample());
  EXPECT_EQ(parse_code(full.substr(0, full.size() / 2)), StatusCode::kCorrupt);
  EXPECT_EQ(parse_code("[1,2,3]"), StatusCode::kCorrupt);
}

TEST(Format, UnknownVersionIsVersionMismatch) {
  auto j = sample_json();
  j["version"] = 99;
  auto r = parse_manifest(seal_manifest(j.dump()).value(), "m.json");
  EXPECT_EQ(r.status().code(), StatusCode::kVersionMismatch);
  EXPECT_NE(r.status().message().find("99"), std::string::npos);
  EXPECT_EQ(r.status().path(), "m.json");
}

TEST(Format, EveryAlteredByteBreaksTheSeal) {
  const std::string text = to_json(sample());
  ASSERT_TRUE(parse_manifest(text, "m.json").ok());
  for (size_t i = 0; i < text.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = text;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      auto r = parse_manifest(bad, "m.json");
      ASSERT_FALSE(r.ok()) << "byte " << i << " bit " << bit << " of " << text;
      EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << i;
    }
  }
}

TEST(Format, UnsealedVersionTwoIsCorruptAndVersionOneStillReads) {
  auto j = sample_json();
  EXPECT_EQ(parse_manifest(j.dump(), "m.json").status().code(), StatusCode::kCorrupt);
  j["version"] = 1;
  EXPECT_TRUE(parse_manifest(j.dump(), "m.json").ok());
  auto resealed = seal_manifest(to_json(sample()));  // resealing a sealed text is idempotent
  ASSERT_TRUE(resealed.ok());
  EXPECT_EQ(*resealed, to_json(sample()));
}

TEST(Format, DeepNestingIsCorruptNotACrash) {
  std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto j = sample_json();
  std::string text = j.dump();
  text.insert(text.size() - 1, ",\"x\":" + deep);
  EXPECT_EQ(parse_code(text), StatusCode::kCorrupt);
  std::string quoted =
      ",\"y\":\"" + std::string(1000, '[') + "\"";  // brackets in a string count not
  std::string ok = j.dump();
  ok.insert(ok.size() - 1, quoted);
  EXPECT_EQ(parse_code(ok), StatusCode::kOk);
}

TEST(Format, DuplicateTensorNamesAreCorrupt) {
  auto j = sample_json();
  j["tensors"][1] = j["tensors"][0];
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
}

TEST(Format, RejectsPathsThatEscapeTheDirectory) {
  for (const char* bad : {"../../etc/passwd", "/etc/passwd", "a/b.data", "..", ".hidden", ""}) {
    auto j = sample_json();
    j["shards"][0]["file"] = bad;
    EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt) << bad;
  }
}

TEST(Format, RejectsAbsurdSizesAndInconsistentEntries) {
  auto j = sample_json();
  j["tensors"][0]["shape"] = {1ll << 40, 1ll << 40};
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
  j = sample_json();
  j["tensors"][0]["nbytes"] = 25;
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
  j = sample_json();
  j["tensors"][0]["chunks"][0]["raw"] = 20;
  j["tensors"][0]["chunks"][0]["len"] = 20;
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);  // chunks do not cover the tensor
  j = sample_json();
  j["tensors"][0]["chunks"][0]["len"] = 1ull << 40;
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
  j = sample_json();
  j["tensors"][0]["shard"] = 7;
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
  j = sample_json();
  j["tensors"][0]["dtype"] = "float128";
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
  j = sample_json();
  j["tensors"][0]["shape"] = {-2, -12};
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
  j = sample_json();
  j["tensors"][0]["chunks"][0]["xxh3"] = "not-hex";
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
  j = sample_json();
  j["tensors"][0]["chunks"][0]["codec"] = "lzma";
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
  j = sample_json();
  j["tensors"][0]["name"] = 5;
  EXPECT_EQ(parse_code(j.dump()), StatusCode::kCorrupt);
}

TEST(Format, ChecksExtentsAgainstFileSizes) {
  auto m = sample();
  EXPECT_TRUE(check_extents(m, {8192}).ok());
  auto s = check_extents(m, {16});
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_EQ(s.path(), "rank-00000.data");
}

TEST(Format, Names) {
  EXPECT_EQ(step_dir_name(42), "step-000000000042");
  EXPECT_EQ(parse_step_dir_name("step-000000000042"), 42);
  EXPECT_EQ(parse_step_dir_name("step-00000000004x"), -1);
  EXPECT_EQ(parse_step_dir_name(".tmp-step-000000000042"), -1);
  // Steps past 12 digits: one name each, the whole int64 range, nothing beyond.
  const int64_t big = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(parse_step_dir_name(step_dir_name(big)), big);
  EXPECT_EQ(parse_step_dir_name(step_dir_name(1'763'900'000'000)), 1'763'900'000'000);
  EXPECT_EQ(parse_step_dir_name("step-0000000000042"), -1);        // a second name for 42
  EXPECT_EQ(parse_step_dir_name("step-9223372036854775808"), -1);  // int64 overflow
  EXPECT_EQ(shard_file_name(3), "rank-00003.data");
  EXPECT_EQ(dtype_size("bfloat16"), 2u);
  EXPECT_EQ(dtype_size("nope"), 0u);
}

// Data files: small tensors are packed at their element alignment, large ones start on a 4 KiB
// boundary, the image ends on one; chunks never cross a slab.
TEST(Layout, PacksSmallTensorsAndAlignsLargeOnes) {
  std::vector<std::byte> buf(1 << 20);
  const void* p = buf.data();
  const uint64_t big = kPackBelowBytes;  // the smallest aligned size
  std::vector<TensorSpec> specs = {{"a", "uint8", {3}, p, 3},
                                   {"b", "float64", {1}, p, 8},
                                   {"c", "bfloat16", {5}, p, 10},
                                   {"empty", "float32", {0}, nullptr, 0},
                                   {"big", "uint8", {int64_t(big)}, p, big},
                                   {"d", "int32", {1}, p, 4},
                                   {"e", "complex128", {2}, p, 32}};
  auto l = plan_layout(specs, 256 << 10, 16 << 20);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  auto off = [&](size_t i) { return l->tensors[i].chunks.at(0).offset; };
  EXPECT_EQ(off(0), 0u);
  EXPECT_EQ(off(1), 8u);  // 3 rounded up to float64's 8
  EXPECT_EQ(off(2), 16u);
  EXPECT_TRUE(l->tensors[3].chunks.empty());
  EXPECT_EQ(off(4), 4096u);  // large: aligned
  EXPECT_EQ(off(5), 4096u + big);
  EXPECT_EQ(off(6), 4096u + big + 16);  // complex128: 16-byte aligned
  EXPECT_EQ(l->bytes, 4096u + big + 4096);

  // 50,000 one-element tensors cost their payload, rounded up to 4 KiB once.
  std::vector<TensorSpec> many;
  for (int i = 0; i < 50'000; ++i) many.push_back({"t" + std::to_string(i), "float32", {1}, p, 4});
  l = plan_layout(many, 256 << 10, 16 << 20);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->bytes, io::align_up(200'000));
  // A small tensor that straddles a slab boundary is cut there.
  std::vector<TensorSpec> edge = {{"x", "uint8", {4092}, p, 4092}, {"y", "float32", {2}, p, 8}};
  l = plan_layout(edge, 4096, 16 << 20);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->tensors[1].chunks.size(), 2u);
  EXPECT_EQ(l->tensors[1].chunks[0].offset, 4092u);
  EXPECT_EQ(l->tensors[1].chunks[0].raw, 4u);
  EXPECT_EQ(l->tensors[1].chunks[1].offset, 4096u);
}

}  // namespace
}  // namespace resilient::checkpoint
