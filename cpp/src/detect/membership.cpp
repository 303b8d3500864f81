#include "resilient/detect/membership.hpp"

#include <algorithm>
#include <charconv>
#include <sstream>

namespace resilient::detect {
namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  if (s.empty()) return out;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos == std::string_view::npos ? s.size() - start : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return out;
}

bool to_int(std::string_view s, int64_t* v) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
  return ec == std::errc() && p == s.data() + s.size();
}

Status corrupt(const std::string& why) {
  return Status(StatusCode::kCorrupt, "generation record: " + why);
}

}  // namespace

bool Generation::contains(int32_t rank) const {
  return std::binary_search(live.begin(), live.end(), rank);
}

std::string Generation::serialize() const {
  std::ostringstream os;
  os << "g=" << number << ";live=";
  // Ranges keep the record short: 100k live ranks with a few holes is a few dozen bytes.
  for (size_t i = 0; i < live.size();) {
    size_t j = i;
    while (j + 1 < live.size() && live[j + 1] == live[j] + 1) ++j;
    if (i) os << ',';
    os << live[i];
    if (j > i) os << '-' << live[j];
    i = j + 1;
  }
  os << ";removed=";
  for (size_t i = 0; i < removed.size(); ++i) {
    if (i) os << ',';
    os << removed[i].rank << ':' << static_cast<int>(removed[i].reason) << ':'
       << removed[i].section;
  }
  return os.str();
}

Result<Generation> Generation::parse(std::string_view text) {
  auto parts = split(text, ';');
  if (parts.size() != 3 || parts[0].substr(0, 2) != "g=" || parts[1].substr(0, 5) != "live=" ||
      parts[2].substr(0, 8) != "removed=") {
    return corrupt("bad layout");
  }
  Generation g;
  int64_t v = 0;
  if (!to_int(parts[0].substr(2), &v) || v < 0) return corrupt("bad number");
  g.number = static_cast<uint64_t>(v);
  for (auto item : split(parts[1].substr(5), ',')) {
    size_t dash = item.find('-');
    int64_t a = 0, b = 0;
    if (!to_int(item.substr(0, dash), &a)) return corrupt("bad rank");
    b = a;
    if (dash != std::string_view::npos && !to_int(item.substr(dash + 1), &b))
      return corrupt("bad range");
    if (a < 0 || b < a || (!g.live.empty() && a <= g.live.back())) return corrupt("unsorted ranks");
    for (int64_t r = a; r <= b; ++r) g.live.push_back(static_cast<int32_t>(r));
  }
  for (auto item : split(parts[2].substr(8), ',')) {
    auto f = split(item, ':');
    int64_t rank = 0, reason = 0;
    if (f.size() != 3 || !to_int(f[0], &rank) || !to_int(f[1], &reason) || reason < 1 ||
        reason > 3) {
      return corrupt("bad removal");
    }
    g.removed.push_back(
        {static_cast<int32_t>(rank), static_cast<Reason>(reason), std::string(f[2])});
  }
  return g;
}

Generation Generation::next(const std::vector<Verdict>& failed) const {
  Generation n;
  n.number = number + 1;
  n.live.reserve(live.size());
  std::vector<int32_t> gone;
  for (const Verdict& v : failed) {
    if (contains(v.rank) && std::find(gone.begin(), gone.end(), v.rank) == gone.end()) {
      gone.push_back(v.rank);
      n.removed.push_back(v);
    }
  }
  std::sort(gone.begin(), gone.end());
  std::set_difference(live.begin(), live.end(), gone.begin(), gone.end(),
                      std::back_inserter(n.live));
  std::sort(n.removed.begin(), n.removed.end(),
            [](const Verdict& a, const Verdict& b) { return a.rank < b.rank; });
  return n;
}

Generation Generation::initial(int32_t world_size) {
  Generation g;
  g.live.resize(world_size);
  for (int32_t i = 0; i < world_size; ++i) g.live[i] = i;
  return g;
}

std::vector<int32_t> ring_successors(const std::vector<int32_t>& live, int32_t rank, int count) {
  std::vector<int32_t> out;
  if (live.empty()) return out;
  size_t n = live.size();
  size_t i = std::upper_bound(live.begin(), live.end(), rank) - live.begin();
  for (size_t k = 0; k < n && static_cast<int>(out.size()) < count; ++k) {
    int32_t r = live[(i + k) % n];
    if (r != rank) out.push_back(r);
  }
  return out;
}

std::vector<int32_t> ring_predecessors(const std::vector<int32_t>& live, int32_t rank, int count) {
  std::vector<int32_t> out;
  if (live.empty()) return out;
  size_t n = live.size();
  size_t i = std::lower_bound(live.begin(), live.end(), rank) - live.begin();  // first >= rank
  for (size_t k = 1; k <= n && static_cast<int>(out.size()) < count; ++k) {
    int32_t r = live[(i + n - k) % n];
    if (r != rank) out.push_back(r);
  }
  return out;
}

std::string generation_key(const std::string& prefix, uint64_t g) {
  return prefix + "/gen/" + std::to_string(g);
}

Result<Generation> decide_generation(Store& store, const std::string& prefix,
                                     const Generation& proposal, Duration timeout) {
  RESILIENT_ASSIGN_OR_RETURN(std::string value,
                             store.compare_set(generation_key(prefix, proposal.number), "",
                                               proposal.serialize(), timeout));
  RESILIENT_ASSIGN_OR_RETURN(Generation g, Generation::parse(value));
  if (g.number != proposal.number)
    return corrupt("number mismatch at " + std::to_string(proposal.number));
  return g;
}

Result<Generation> read_generation(Store& store, const std::string& prefix, uint64_t g,
                                   Duration timeout) {
  RESILIENT_ASSIGN_OR_RETURN(std::string value,
                             store.get(generation_key(prefix, g), timeout, IfAbsent::kFail));
  RESILIENT_ASSIGN_OR_RETURN(Generation out, Generation::parse(value));
  if (out.number != g) return corrupt("number mismatch at " + std::to_string(g));
  return out;
}

}  // namespace resilient::detect
