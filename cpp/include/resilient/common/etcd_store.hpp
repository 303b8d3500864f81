#pragma once
// EtcdStore: the Store contract (store.hpp) on an etcd v3 cluster, through the JSON gateway that
// etcd serves on its client port (POST /v3/kv/put, /v3/kv/range, /v3/kv/txn; keys and values
// base64) with libcurl. etcd is replicated (Raft) and linearizable: the job's store keeps
// answering while a majority of its members is up, so its host is no single point of failure.
//
// How a call maps to etcd:
// - set: one put. get: one range (linearizable read); get(kWait) polls the key every 10 ms,
//   backing off to 100 ms, until the call's deadline (one range per waiter per 100 ms at worst).
// - compare_set: one txn: compare create_revision == 0 (empty `expected`) or value == expected;
//   on success put `desired`, on failure range the key. A retried txn whose first try was
//   applied but not answered still returns `desired` (the compare fails, the range reads it).
// - Every key is stored as options.prefix + key (the same layout as resilient.etcd.EtcdStore in
//   Python, so both sides of one job see one key space).
//
// Members and deadlines: a request goes to the member that answered last. A member that refuses
// or resets the connection is left for the next at once; one that does not answer within a
// per-try budget (a quarter of the call's timeout, clamped to 0.5..1 s: a member holds a request
// through a leader election) is left for the next too. When every member refused the connection
// in one round the call fails with kUnavailable at once; when the deadline passes with some member
// reached but no answer (a frozen server, no quorum, a partition) it fails with kTimeout.
// A write that failed with kTimeout may still take effect later (a frozen or partitioned member
// serves the requests it already received when it recovers): callers that must know read back,
// as compare_set's return value does on a retry.
//
// Credentials: the password is read from RESILIENT_ETCD_PASSWORD (never from a URL, which ends
// up in logs); it and the auth token never appear in a Status message or a log line.

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"
#include "resilient/common/store.hpp"

namespace resilient {

/// Where and how to reach etcd.
struct EtcdOptions {
  /// Client endpoints, "host:port" each (tried in turn).
  std::vector<std::string> endpoints;
  /// Prepended to every key: one run's keys apart from another's (e.g. "job42/").
  std::string prefix;
  /// https instead of http. Needs ca_file.
  bool tls = false;
  /// PEM files: the CA that signed the members' certificates; a client certificate and its key
  /// (both or neither) when etcd asks for client certificates.
  std::string ca_file, cert_file, key_file;
  /// etcd user (auth enabled): a token from /v3/auth/authenticate goes with every request.
  std::string user;
  /// The user's password. Not printed anywhere.
  std::string password;

  /// Parses "etcd://[user@]h1:2379,h2:2379[/prefix][?ca=..&cert=..&key=..]" ("etcds://" for TLS,
  /// which needs ca). A password in the URL is refused. Errors: kInvalidArgument.
  static Result<EtcdOptions> from_url(std::string_view url);

  /// from_url(url), then the password from RESILIENT_ETCD_PASSWORD when the URL names a user,
  /// then validate(). Errors: kInvalidArgument.
  static Result<EtcdOptions> from_env(std::string_view url);

  /// kInvalidArgument naming the first bad field: at least one endpoint, each "host:port" with a
  /// port in 1..65535; tls needs ca_file; cert_file and key_file together; a password needs a
  /// user and a user a password.
  Status validate() const;
};

/// The Store contract on etcd (see the top of this file). Thread-safe: calls from many threads
/// run concurrently, each on its own connection from a small pool. Construction does no I/O.
class EtcdStore final : public Store {
 public:
  /// Errors: kInvalidArgument from options.validate().
  static Result<std::unique_ptr<EtcdStore>> create(EtcdOptions options);
  ~EtcdStore() override;
  EtcdStore(const EtcdStore&) = delete;
  EtcdStore& operator=(const EtcdStore&) = delete;

  Status set(const std::string& key, const std::string& value, Duration timeout) override;
  Result<std::string> get(const std::string& key, Duration timeout, IfAbsent if_absent) override;
  Result<std::string> compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired, Duration timeout) override;

  const EtcdOptions& options() const { return options_; }
  /// HTTP requests sent so far (each try counts), for tests and load estimates.
  size_t requests() const { return requests_.load(); }

 private:
  struct Pool;
  explicit EtcdStore(EtcdOptions options);

  // POSTs `body` (JSON) to `path` on some member before `deadline`; the reply's JSON text.
  Result<std::string> post(const std::string& path, const std::string& body, TimePoint deadline);
  // One request to one member: the HTTP status and body, or a curl failure.
  struct Reply;
  Reply send(size_t member, const std::string& path, const std::string& body, Duration budget,
             bool with_token);
  Status authenticate(size_t member, Duration budget);
  // The value of prefixed key `key` (base64), kNotFound when absent.
  Result<std::string> range(const std::string& key64, TimePoint deadline);

  EtcdOptions options_;
  std::unique_ptr<Pool> pool_;
  std::atomic<size_t> preferred_{0};
  std::atomic<size_t> requests_{0};
  std::mutex token_mu_;
  std::string token_;  // guarded by token_mu_
};

/// A Store selected by URL: "etcd://..." or "etcds://..." is an EtcdStore
/// (EtcdOptions::from_env), "memory://" a process-local InMemoryStore.
/// Errors: kInvalidArgument for an unknown scheme or a malformed URL.
Result<std::unique_ptr<Store>> connect_store(std::string_view url);

}  // namespace resilient
