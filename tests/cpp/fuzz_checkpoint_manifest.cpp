// libFuzzer target: the manifest parser must turn any input into a Manifest or an error Status,
// never crash, hang or over-allocate; a parsed manifest must survive a round trip.
#include <cstddef>
#include <cstdint>
#include <string>

#include "resilient/checkpoint/format.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace resilient::checkpoint;
  std::string text(reinterpret_cast<const char*>(data), size);
  auto m = parse_manifest(text, "fuzz.json");
  if (m.ok()) {
    auto again = parse_manifest(to_json(*m), "fuzz.json");
    if (!again.ok() || again->tensors.size() != m->tensors.size()) __builtin_trap();
  }
  return 0;
}
