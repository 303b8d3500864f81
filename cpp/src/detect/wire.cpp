#include "resilient/detect/wire.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstring>

namespace resilient::detect {
namespace {

constexpr uint32_t kMagic = 0x54445352;  // "RSDT"
constexpr size_t kHeader = 4 + 1 + 1 + 2 + 8 + 8 + 4 + 4 + 8 + 8 + 8 + 8 + 8 + 8 + 2;
constexpr size_t kVersionAt = 4;

template <typename T>
void put(std::string& out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(buf, sizeof(T));
}

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  template <typename T>
  bool get(T* v) {
    if (s_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, s_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool bytes(size_t n, std::string* out) {
    if (s_.size() - pos_ < n) return false;
    out->assign(s_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }

 private:
  std::string_view s_;
  size_t pos_ = 0;
};

void mac(std::string_view key, std::string_view data, unsigned char* out) {
  unsigned int len = kMacSize;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len);
}

// The per-run MAC key: a datagram authenticated in one run fails the MAC in every other run.
std::string derive_key(const std::string& key, uint64_t job, std::string_view run) {
  std::string label = "resilient-detect/2";
  put(label, job);
  label.append(run.data(), run.size());
  unsigned char out[kMacSize];
  mac(key, label, out);
  return std::string(reinterpret_cast<const char*>(out), kMacSize);
}

}  // namespace

const char* reason_name(Reason r) {
  switch (r) {
    case Reason::kCrash:
      return "crash";
    case Reason::kUnresponsive:
      return "unresponsive";
    case Reason::kHang:
      return "hang";
  }
  return "?";
}

uint64_t job_id(std::string_view job_name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : job_name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

Codec::Codec(std::string key, uint64_t job, std::string_view run)
    : mac_key_(derive_key(key, job, run)), job_(job), run_(run_hash(run)) {}

std::string Codec::encode(Message msg) const {
  std::string out;
  out.reserve(256);
  put(out, kMagic);
  put(out, kWireVersion);
  put(out, static_cast<uint8_t>(msg.type));
  size_t flags_at = out.size();
  put(out, msg.flags);
  put(out, job_);
  put(out, run_);
  put(out, msg.from);
  put(out, msg.to);
  put(out, msg.generation);
  put(out, msg.seq);
  put(out, msg.time_ns);
  put(out, msg.echo_seq);
  put(out, msg.echo_time_ns);
  put(out, msg.step);
  size_t count_at = out.size();
  put(out, uint16_t{0});
  uint16_t n = 0;
  for (const Verdict& v : msg.verdicts) {
    size_t slen = std::min<size_t>(v.section.size(), 255);
    if (out.size() + 6 + slen + kMacSize > kMaxDatagram) {
      uint16_t f = msg.flags & ~kFlagComplete;
      std::memcpy(out.data() + flags_at, &f, sizeof f);
      break;
    }
    put(out, v.rank);
    put(out, static_cast<uint8_t>(v.reason));
    put(out, static_cast<uint8_t>(slen));
    out.append(v.section.data(), slen);
    ++n;
  }
  std::memcpy(out.data() + count_at, &n, sizeof n);
  unsigned char tag[kMacSize];
  mac(mac_key_, out, tag);
  out.append(reinterpret_cast<const char*>(tag), kMacSize);
  return out;
}

Result<Message> Codec::decode(std::string_view d, DropReason* drop) const {
  auto fail = [&](DropReason why, StatusCode code, const char* what) -> Status {
    if (drop) *drop = why;
    return Status(code, what);
  };
  if (drop) *drop = DropReason::kNone;
  // The version is read before anything else: an older layout is never parsed as this one.
  if (d.size() > kVersionAt && static_cast<uint8_t>(d[kVersionAt]) != kWireVersion) {
    uint32_t magic = 0;
    std::memcpy(&magic, d.data(), std::min<size_t>(d.size(), sizeof magic));
    if (magic == kMagic) {
      return fail(DropReason::kBadVersion, StatusCode::kCorrupt, "other wire version");
    }
  }
  if (d.size() < kHeader + kMacSize || d.size() > kMaxDatagram) {
    return fail(DropReason::kMalformed, StatusCode::kCorrupt, "bad datagram size");
  }
  Reader r(d.substr(0, d.size() - kMacSize));
  uint32_t magic = 0;
  uint8_t version = 0, type = 0;
  Message m;
  r.get(&magic);
  r.get(&version);
  r.get(&type);
  if (magic != kMagic || version != kWireVersion) {
    return fail(DropReason::kMalformed, StatusCode::kCorrupt, "bad magic or version");
  }
  r.get(&m.flags);
  r.get(&m.job);
  if (m.job != job_) return fail(DropReason::kOtherJob, StatusCode::kNotFound, "other job");
  r.get(&m.run);
  if (m.run != run_) return fail(DropReason::kOtherRun, StatusCode::kNotFound, "other run");
  unsigned char tag[kMacSize];
  mac(mac_key_, d.substr(0, d.size() - kMacSize), tag);
  if (CRYPTO_memcmp(tag, d.data() + d.size() - kMacSize, kMacSize) != 0) {
    return fail(DropReason::kBadMac, StatusCode::kFailedPrecondition, "bad MAC");
  }
  if (type < 1 || type > 4) return fail(DropReason::kMalformed, StatusCode::kCorrupt, "bad type");
  m.type = static_cast<MsgType>(type);
  uint16_t n = 0;
  r.get(&m.from);
  r.get(&m.to);
  r.get(&m.generation);
  r.get(&m.seq);
  r.get(&m.time_ns);
  r.get(&m.echo_seq);
  r.get(&m.echo_time_ns);
  r.get(&m.step);
  r.get(&n);
  for (uint16_t i = 0; i < n; ++i) {
    Verdict v;
    uint8_t reason = 0, slen = 0;
    if (!r.get(&v.rank) || !r.get(&reason) || !r.get(&slen) || !r.bytes(slen, &v.section) ||
        reason < 1 || reason > 3) {
      return fail(DropReason::kMalformed, StatusCode::kCorrupt, "bad verdict");
    }
    v.reason = static_cast<Reason>(reason);
    m.verdicts.push_back(std::move(v));
  }
  if (r.pos() != d.size() - kMacSize || m.from < 0 || m.to < 0) {
    return fail(DropReason::kMalformed, StatusCode::kCorrupt, "trailing bytes or bad sender");
  }
  return m;
}

}  // namespace resilient::detect
