#include "resilient/common/etcd_store.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <nlohmann/json.hpp>
#include <thread>

#include "resilient/common/config.hpp"

namespace resilient {
namespace {

using json = nlohmann::json;
using std::chrono::milliseconds;

constexpr Duration kMinTry = milliseconds(500);
constexpr Duration kMaxTry = milliseconds(1000);
constexpr Duration kFirstPoll = milliseconds(10);
constexpr Duration kMaxPoll = milliseconds(100);
constexpr size_t kMaxIdleHandles = 16;

Status invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, "etcd: " + std::move(message));
}

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string b64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s : {18, 12, 6, 0}) out += kB64[(v >> s) & 63];
  }
  if (size_t rest = in.size() - i; rest > 0) {
    uint32_t v = uint8_t(in[i]) << 16;
    if (rest == 2) v |= uint8_t(in[i + 1]) << 8;
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += rest == 2 ? kB64[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

Result<std::string> b64_decode(std::string_view in) {
  std::array<int, 256> map;
  map.fill(-1);
  for (int i = 0; i < 64; ++i) map[uint8_t(kB64[i])] = i;
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    int d = map[uint8_t(c)];
    if (d < 0) return Status(StatusCode::kInternal, "etcd: malformed base64 in a reply");
    acc = (acc << 6) | uint32_t(d);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += char((acc >> bits) & 0xff);
    }
  }
  return out;
}

// The value of the first kv of a range reply (its "kvs" array), kNotFound when there is none.
// proto3's JSON leaves an empty value out.
Result<std::string> first_value(const json& range_reply, const std::string& key) {
  auto kvs = range_reply.find("kvs");
  if (kvs == range_reply.end() || !kvs->is_array() || kvs->empty()) {
    return Status(StatusCode::kNotFound, "no store key " + key);
  }
  return b64_decode((*kvs)[0].value("value", std::string()));
}

Result<json> parse(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status(StatusCode::kInternal, "etcd: a reply that is not a JSON object");
  }
  return j;
}

TimePoint now() { return std::chrono::steady_clock::now(); }
Duration remaining(TimePoint deadline) { return deadline - now(); }

size_t write_body(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// "%2F" and friends in URL query values.
std::string percent_decode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(uint8_t(s[i + 1])) &&
        std::isxdigit(uint8_t(s[i + 2]))) {
      out += char(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

// ---- options ----

Result<EtcdOptions> EtcdOptions::from_url(std::string_view url) {
  EtcdOptions o;
  size_t colon = url.find("://");
  if (colon == std::string_view::npos) return invalid("not a URL (etcd://host:port/prefix)");
  std::string_view scheme = url.substr(0, colon), rest = url.substr(colon + 3);
  if (scheme != "etcd" && scheme != "etcds") {
    return invalid("not an etcd URL (etcd://host:port,host:port/prefix): scheme '" +
                   std::string(scheme) + "'");
  }
  o.tls = scheme == "etcds";
  std::string_view query;
  if (size_t q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  std::string_view hosts = rest;
  if (size_t slash = rest.find('/'); slash != std::string_view::npos) {
    hosts = rest.substr(0, slash);
    o.prefix = std::string(rest.substr(slash + 1));
  }
  if (size_t at = hosts.rfind('@'); at != std::string_view::npos) {
    std::string_view userinfo = hosts.substr(0, at);
    if (userinfo.find(':') != std::string_view::npos) {
      return invalid("put the password in RESILIENT_ETCD_PASSWORD, not in the URL");
    }
    o.user = std::string(userinfo);
    hosts = hosts.substr(at + 1);
  }
  while (!hosts.empty()) {
    size_t comma = hosts.find(',');
    std::string_view h = hosts.substr(0, comma);
    if (!h.empty()) o.endpoints.emplace_back(h);
    hosts = comma == std::string_view::npos ? std::string_view() : hosts.substr(comma + 1);
  }
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (kv.empty()) continue;
    size_t eq = kv.find('=');
    std::string name(kv.substr(0, eq));
    std::string value = eq == std::string_view::npos ? "" : percent_decode(kv.substr(eq + 1));
    if (name == "ca") {
      o.ca_file = value;
    } else if (name == "cert") {
      o.cert_file = value;
    } else if (name == "key") {
      o.key_file = value;
    } else {
      return invalid("unknown URL option '" + name + "' (ca, cert, key)");
    }
  }
  if (!o.ca_file.empty()) o.tls = true;
  return o;
}

Result<EtcdOptions> EtcdOptions::from_env(std::string_view url) {
  RESILIENT_ASSIGN_OR_RETURN(EtcdOptions o, from_url(url));
  if (!o.user.empty()) {
    auto password = env_string("RESILIENT_ETCD_PASSWORD");
    if (!password) return invalid("user '" + o.user + "' needs RESILIENT_ETCD_PASSWORD");
    o.password = *password;
  }
  RESILIENT_RETURN_IF_ERROR(o.validate());
  return o;
}

Status EtcdOptions::validate() const {
  if (endpoints.empty()) return invalid("no endpoint (host:port)");
  for (const auto& e : endpoints) {
    size_t colon = e.rfind(':');
    if (colon == std::string::npos || colon == 0)
      return invalid("endpoint '" + e + "' is not host:port");
    auto port = parse_int(std::string_view(e).substr(colon + 1));
    if (!port.ok() || *port < 1 || *port > 65535) {
      return invalid("endpoint '" + e + "' has no port in 1..65535");
    }
  }
  if (tls && ca_file.empty()) return invalid("TLS (etcds://) needs a CA file (?ca=...)");
  if (cert_file.empty() != key_file.empty()) {
    return invalid("a client certificate needs both cert and key");
  }
  if (!password.empty() && user.empty()) return invalid("a password without a user");
  if (!user.empty() && password.empty()) return invalid("user '" + user + "' without a password");
  return ok_status();
}

// ---- store ----

// Idle curl handles (each keeps its connections open for the next request).
struct EtcdStore::Pool {
  std::mutex mu;
  std::vector<CURL*> idle;
  CURL* take() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!idle.empty()) {
        CURL* h = idle.back();
        idle.pop_back();
        return h;
      }
    }
    return curl_easy_init();
  }
  void give(CURL* h) {
    std::lock_guard<std::mutex> lock(mu);
    if (idle.size() < kMaxIdleHandles) {
      idle.push_back(h);
    } else {
      curl_easy_cleanup(h);
    }
  }
  ~Pool() {
    for (CURL* h : idle) curl_easy_cleanup(h);
  }
};

struct EtcdStore::Reply {
  CURLcode curl = CURLE_OK;
  long http = 0;
  std::string body;
  std::string error;  // curl's message, when curl != CURLE_OK
};

EtcdStore::EtcdStore(EtcdOptions options)
    : options_(std::move(options)), pool_(std::make_unique<Pool>()) {}

EtcdStore::~EtcdStore() = default;

Result<std::unique_ptr<EtcdStore>> EtcdStore::create(EtcdOptions options) {
  RESILIENT_RETURN_IF_ERROR(options.validate());
  global_init();
  return std::unique_ptr<EtcdStore>(new EtcdStore(std::move(options)));
}

EtcdStore::Reply EtcdStore::send(size_t member, const std::string& path, const std::string& body,
                                 Duration budget, bool with_token) {
  Reply r;
  CURL* h = pool_->take();
  if (h == nullptr) {
    r.curl = CURLE_FAILED_INIT;
    r.error = "curl_easy_init failed";
    return r;
  }
  std::string url = (options_.tls ? "https://" : "http://") + options_.endpoints[member] + path;
  long ms = std::max<long>(1, std::chrono::duration_cast<milliseconds>(budget).count());
  struct curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  if (with_token) {
    std::lock_guard<std::mutex> lock(token_mu_);
    if (!token_.empty()) headers = curl_slist_append(headers, ("Authorization: " + token_).c_str());
  }
  char err[CURL_ERROR_SIZE] = {0};
  curl_easy_reset(h);
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_POST, 1L);
  curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, long(body.size()));
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, ms);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, ms);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_PROXY, "");  // never through an http_proxy from the environment
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, write_body);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &r.body);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, err);
  if (options_.tls) {
    curl_easy_setopt(h, CURLOPT_CAINFO, options_.ca_file.c_str());
    if (!options_.cert_file.empty()) {
      curl_easy_setopt(h, CURLOPT_SSLCERT, options_.cert_file.c_str());
      curl_easy_setopt(h, CURLOPT_SSLKEY, options_.key_file.c_str());
    }
  }
  ++requests_;
  r.curl = curl_easy_perform(h);
  if (r.curl == CURLE_OK) {
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.http);
  } else {
    r.error = err[0] ? err : curl_easy_strerror(r.curl);
  }
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, nullptr);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);
  curl_slist_free_all(headers);
  pool_->give(h);
  return r;
}

Status EtcdStore::authenticate(size_t member, Duration budget) {
  json req = {{"name", options_.user}, {"password", options_.password}};
  Reply r = send(member, "/v3/auth/authenticate", req.dump(), budget, /*with_token=*/false);
  if (r.curl != CURLE_OK) return Status(StatusCode::kUnavailable, r.error);
  auto j = parse(r.body);
  if (r.http != 200 || !j.ok() || !j->contains("token")) {
    // etcd's message ("authentication failed, invalid user ID or password") names no secret.
    std::string why = j.ok() ? j->value("error", std::string("HTTP ") + std::to_string(r.http))
                             : "HTTP " + std::to_string(r.http);
    return Status(StatusCode::kFailedPrecondition,
                  "etcd: authenticating user '" + options_.user + "': " + why);
  }
  std::lock_guard<std::mutex> lock(token_mu_);
  token_ = (*j)["token"].get<std::string>();
  return ok_status();
}

Result<std::string> EtcdStore::post(const std::string& path, const std::string& body,
                                    TimePoint deadline) {
  const size_t n = options_.endpoints.size();
  const bool auth = !options_.user.empty();
  bool reached = false;  // some member accepted the connection (then: kTimeout at the deadline)
  bool reauthenticated = false;
  std::string last_error = "no request sent";
  Duration pause = kFirstPoll;
  for (bool first = true;; first = false) {
    if (!first && remaining(deadline) <= Duration::zero()) break;
    size_t refused = 0;
    size_t start = preferred_.load();
    for (size_t k = 0; k < n; ++k) {
      Duration left = remaining(deadline);
      if (!(first && k == 0) && left <= Duration::zero()) break;
      size_t member = (start + k) % n;
      Duration budget = std::clamp(left / 4, kMinTry, kMaxTry);
      budget = std::max(std::min(budget, left), Duration(milliseconds(1)));
      const std::string& where = options_.endpoints[member];
      if (auth) {
        bool have_token;
        {
          std::lock_guard<std::mutex> lock(token_mu_);
          have_token = !token_.empty();
        }
        if (!have_token) {
          Status st = authenticate(member, budget);
          if (st.code() == StatusCode::kFailedPrecondition) return st;
          if (!st.ok()) {
            last_error = where + ": " + st.message();
            ++refused;
            continue;
          }
        }
      }
      Reply r = send(member, path, body, budget, auth);
      if (r.curl == CURLE_OPERATION_TIMEDOUT) {
        reached = true;
        last_error = where + ": no answer within " + std::to_string(to_seconds(budget)) + " s";
        continue;
      }
      if (r.curl != CURLE_OK) {  // refused, reset, unresolvable, TLS failure: the next member
        last_error = where + ": " + r.error;
        ++refused;
        continue;
      }
      reached = true;
      auto j = parse(r.body);
      if (r.http == 200 && j.ok()) {
        preferred_.store(member);
        return std::move(r.body);
      }
      std::string error = j.ok() ? j->value("error", j->value("message", std::string())) : "";
      last_error = where + ": HTTP " + std::to_string(r.http) + (error.empty() ? "" : " ") + error;
      if (auth && error.find("invalid auth token") != std::string::npos && !reauthenticated) {
        reauthenticated = true;  // an expired token: authenticate again, once
        std::lock_guard<std::mutex> lock(token_mu_);
        token_.clear();
        continue;
      }
      int code = j.ok() ? j->value("code", 0) : 0;
      if (code == 7 || code == 16 || error.find("user name is empty") != std::string::npos) {
        // PermissionDenied, Unauthenticated, or no user while auth is on: not worth a retry
        return Status(StatusCode::kFailedPrecondition, "etcd: " + last_error);
      }
      if (code == 3 || r.http == 400) return invalid(last_error);  // InvalidArgument
      // anything else (no leader, leader changed, a member stopping): another member, then retry
    }
    if (refused == n) {
      return Status(StatusCode::kUnavailable, "etcd: no member reachable (" + last_error + ")");
    }
    Duration left = remaining(deadline);
    if (left <= Duration::zero()) break;
    std::this_thread::sleep_for(std::min(pause, left));
    pause = std::min(pause * 2, kMaxPoll);
  }
  if (!reached) {
    return Status(StatusCode::kUnavailable, "etcd: no member reachable (" + last_error + ")");
  }
  return Status(StatusCode::kTimeout, "etcd: no answer in time (" + last_error + ")");
}

Status EtcdStore::set(const std::string& key, const std::string& value, Duration timeout) {
  json req = {{"key", b64_encode(options_.prefix + key)}, {"value", b64_encode(value)}};
  auto r = post("/v3/kv/put", req.dump(), now() + timeout);
  if (!r.ok()) return Status(r.status()).prepend("setting '" + key + "'");
  return ok_status();
}

Result<std::string> EtcdStore::range(const std::string& key, TimePoint deadline) {
  json req = {{"key", b64_encode(options_.prefix + key)}};
  RESILIENT_ASSIGN_OR_RETURN(std::string text, post("/v3/kv/range", req.dump(), deadline));
  RESILIENT_ASSIGN_OR_RETURN(json reply, parse(text));
  return first_value(reply, key);
}

Result<std::string> EtcdStore::get(const std::string& key, Duration timeout, IfAbsent if_absent) {
  const TimePoint deadline = now() + timeout;
  Duration pause = kFirstPoll;
  for (;;) {
    Result<std::string> v = range(key, deadline);
    if (v.ok() || v.status().code() != StatusCode::kNotFound || if_absent == IfAbsent::kFail) {
      return v;
    }
    Duration left = remaining(deadline);
    if (left <= Duration::zero()) {
      return Status(StatusCode::kTimeout, "store key '" + key + "' not set within " +
                                              std::to_string(to_seconds(timeout)) + " s");
    }
    std::this_thread::sleep_for(std::min(pause, left));
    pause = std::min(pause * 2, kMaxPoll);
  }
}

Result<std::string> EtcdStore::compare_set(const std::string& key, const std::string& expected,
                                           const std::string& desired, Duration timeout) {
  const std::string key64 = b64_encode(options_.prefix + key);
  json compare = expected.empty() ? json{{"key", key64},
                                         {"result", "EQUAL"},
                                         {"target", "CREATE"},
                                         {"create_revision", "0"}}
                                  : json{{"key", key64},
                                         {"result", "EQUAL"},
                                         {"target", "VALUE"},
                                         {"value", b64_encode(expected)}};
  json req = {{"compare", json::array({compare})},
              {"success",
               json::array({{{"request_put", {{"key", key64}, {"value", b64_encode(desired)}}}}})},
              {"failure", json::array({{{"request_range", {{"key", key64}}}}})}};
  auto text = post("/v3/kv/txn", req.dump(), now() + timeout);
  if (!text.ok()) return Status(text.status()).prepend("compare_set '" + key + "'");
  RESILIENT_ASSIGN_OR_RETURN(json reply, parse(*text));
  if (reply.value("succeeded", false)) return desired;
  auto responses = reply.find("responses");
  if (responses == reply.end() || !responses->is_array() || responses->empty()) {
    return Status(StatusCode::kInternal, "etcd: a txn reply without its range");
  }
  return first_value((*responses)[0].value("response_range", json::object()), key);
}

Result<std::unique_ptr<Store>> connect_store(std::string_view url) {
  if (url == "memory://") return std::unique_ptr<Store>(std::make_unique<InMemoryStore>());
  if (url.starts_with("etcd://") || url.starts_with("etcds://")) {
    RESILIENT_ASSIGN_OR_RETURN(EtcdOptions options, EtcdOptions::from_env(url));
    RESILIENT_ASSIGN_OR_RETURN(std::unique_ptr<EtcdStore> store,
                               EtcdStore::create(std::move(options)));
    return std::unique_ptr<Store>(std::move(store));
  }
  // only the scheme: the rest of a foreign URL may hold a password
  return invalid("unknown store URL scheme '" + std::string(url.substr(0, url.find("://"))) +
                 "' (etcd://host:port,..., etcds://, memory://)");
}

}  // namespace resilient
