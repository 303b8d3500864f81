// EtcdStore against real etcd servers the tests start and stop themselves (free ports on
// 127.0.0.1, a temporary data directory, every wait bounded, killed in TearDown).
// scripts/setup.sh installs etcd-server; without it these tests fail, saying so.
#include "resilient/common/etcd_store.hpp"

#include <curl/curl.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <vector>

namespace resilient {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

constexpr const char* kEtcd = "/usr/bin/etcd";

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

size_t append(char* d, size_t s, size_t n, void* out) {
  static_cast<std::string*>(out)->append(d, s * n);
  return s * n;
}

// POSTs `body` to `path` on the (plain http) member at `port`; the reply, or an empty object
// when it does not answer.
nlohmann::json post(int port, const std::string& path, const std::string& body = "{}") {
  std::string reply;
  CURL* h = curl_easy_init();
  std::string url = "http://127.0.0.1:" + std::to_string(port) + path;
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 1000L);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_PROXY, "");
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, append);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &reply);
  CURLcode rc = curl_easy_perform(h);
  curl_easy_cleanup(h);
  if (rc != CURLE_OK) return nlohmann::json::object();
  auto j = nlohmann::json::parse(reply, nullptr, false);
  return j.is_object() ? j : nlohmann::json::object();
}

nlohmann::json member_status(int port) { return post(port, "/v3/maintenance/status"); }

// n etcd members on 127.0.0.1, each in its own process group.
class EtcdCluster {
 public:
  // `tls`: the client port serves https with certificates from make_certs() (in dir()), and asks
  // for a client certificate.
  // `extra`: more etcd flags for every member.
  explicit EtcdCluster(int n, bool tls = false, std::vector<std::string> extra = {})
      : n_(n), tls_(tls) {
    char tmpl[] = "/tmp/resilient-etcd-XXXXXX";
    dir_ = mkdtemp(tmpl);
    if (tls_) make_certs();
    for (int i = 0; i < n; ++i) {
      client_.push_back(free_port());
      peer_.push_back(free_port());
    }
    std::string cluster;
    for (int i = 0; i < n; ++i) {
      cluster += (i ? "," : "") + name(i) + "=" + url(peer_[i]);
    }
    for (int i = 0; i < n; ++i) {
      std::vector<std::string> args = {kEtcd,
                                       "--name",
                                       name(i),
                                       "--data-dir",
                                       (dir_ / name(i)).string(),
                                       "--listen-client-urls",
                                       client_url(client_[i]),
                                       "--advertise-client-urls",
                                       client_url(client_[i]),
                                       "--listen-peer-urls",
                                       url(peer_[i]),
                                       "--initial-advertise-peer-urls",
                                       url(peer_[i]),
                                       "--initial-cluster",
                                       cluster,
                                       "--initial-cluster-state",
                                       "new",
                                       "--initial-cluster-token",
                                       "t" + std::to_string(peer_[0]),
                                       "--heartbeat-interval",
                                       "50",
                                       "--election-timeout",
                                       "500"};
      if (tls_) {
        for (const char* a : {"--cert-file", "server.pem", "--key-file", "server.key",
                              "--trusted-ca-file", "ca.pem"}) {
          args.push_back(a[0] == '-' ? a : (dir_ / a).string());
        }
        args.push_back("--client-cert-auth");
      }
      args.insert(args.end(), extra.begin(), extra.end());
      std::string log = (dir_ / (name(i) + ".log")).string();
      pid_t pid = fork();
      if (pid == 0) {
        setpgid(0, 0);
        int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        execv(kEtcd, argv.data());
        _exit(127);
      }
      pids_.push_back(pid);
    }
  }
  ~EtcdCluster() {
    for (int i = 0; i < n_; ++i) kill_member(i);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // The index of the leader, once every live member names the same one; -1 after `limit`.
  int wait_leader(Duration limit = seconds(20)) {
    auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
      std::set<std::string> leaders;
      int leader = -1;
      bool all = true;
      for (int i = 0; i < n_; ++i) {
        if (pids_[i] < 0) continue;
        auto s = member_status(client_[i]);
        std::string l = s.value("leader", std::string());
        if (l.empty() || l == "0") {
          all = false;
          break;
        }
        leaders.insert(l);
        if (s.contains("header") && s["header"].value("member_id", std::string()) == l) leader = i;
      }
      if (all && leaders.size() == 1 && leader >= 0) return leader;
      std::this_thread::sleep_for(milliseconds(50));
    }
    return -1;
  }

  void kill_member(int i) {
    if (pids_[i] < 0) return;
    ::kill(-pids_[i], SIGCONT);
    ::kill(-pids_[i], SIGKILL);
    waitpid(pids_[i], nullptr, 0);
    pids_[i] = -1;
  }
  void signal_member(int i, int sig) { ::kill(-pids_[i], sig); }
  // SIGSTOP, then waits (bounded) until the kernel shows the member stopped: kill() returns
  // before a busy process's threads have all stopped.
  bool freeze_member(int i) {
    signal_member(i, SIGSTOP);
    for (auto end = Clock::now() + seconds(5); Clock::now() < end;) {
      std::ifstream stat("/proc/" + std::to_string(pids_[i]) + "/stat");
      std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
      size_t paren = text.rfind(')');
      if (paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T') {
        return true;
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    return false;
  }
  int client_port(int i) const { return client_[i]; }
  const fs::path& dir() const { return dir_; }

  // The members' client endpoints, member `first` first (the one a new store asks first).
  std::string store_url(const std::string& prefix, int first = 0) const {
    std::string u = "etcd://";
    for (int k = 0; k < n_; ++k) {
      u += (k ? ",127.0.0.1:" : "127.0.0.1:") + std::to_string(client_[(first + k) % n_]);
    }
    return u + "/" + prefix;
  }
  std::unique_ptr<EtcdStore> store(const std::string& prefix, int first = 0) const {
    auto o = EtcdOptions::from_url(store_url(prefix, first));
    EXPECT_TRUE(o.ok()) << o.status().to_string();
    auto s = EtcdStore::create(*o);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return std::move(s).value();
  }

 private:
  static std::string name(int i) { return "m" + std::to_string(i); }
  static std::string url(int port) { return "http://127.0.0.1:" + std::to_string(port); }
  std::string client_url(int port) const {
    return (tls_ ? "https://127.0.0.1:" : "http://127.0.0.1:") + std::to_string(port);
  }
  // A CA, a server certificate for 127.0.0.1 and a client certificate (EC keys: fast).
  void make_certs() {
    std::string d = dir_.string();
    std::string cmd =
        "cd " + d +
        " && (printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext"
        " && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
        "    -keyout ca.key -out ca.pem -days 1 -subj /CN=test-ca"
        " && for n in server client; do"
        "      openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
        "        -keyout $n.key -out $n.csr -subj /CN=$n"
        "   && openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key -CAcreateserial"
        "        -out $n.pem -days 1 -extfile san.ext || exit 1; done) > certs.log 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl failed: see " << d << "/certs.log";
  }

  int n_;
  bool tls_;
  fs::path dir_;
  std::vector<int> client_, peer_;
  std::vector<pid_t> pids_;
};

void require_etcd() {
  ASSERT_EQ(access(kEtcd, X_OK), 0)
      << kEtcd << " is missing: scripts/setup.sh installs it (apt-get install etcd-server)";
}

// One single-member cluster for the contract tests (each test uses its own prefix).
class EtcdStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (access(kEtcd, X_OK) != 0) return;
    cluster_ = new EtcdCluster(1);
    leader_ = cluster_->wait_leader();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override {
    require_etcd();
    ASSERT_GE(leader_, 0) << "etcd did not start";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    store_ = cluster_->store(std::string(info->name()) + "/");
  }

  static EtcdCluster* cluster_;
  static int leader_;
  std::unique_ptr<EtcdStore> store_;
};
EtcdCluster* EtcdStoreTest::cluster_ = nullptr;
int EtcdStoreTest::leader_ = -1;

constexpr Duration kT = seconds(5);

TEST_F(EtcdStoreTest, SetThenGetAndAbsentKeyIsNotFound) {
  ASSERT_TRUE(store_->set("a", "1", kT).ok());
  auto v = store_->get("a", kT, IfAbsent::kFail);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, "1");
  ASSERT_TRUE(store_->set("a", "2", kT).ok());
  EXPECT_EQ(*store_->get("a", kT, IfAbsent::kFail), "2");
  auto missing = store_->get("nope", kT, IfAbsent::kFail);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

TEST_F(EtcdStoreTest, ValuesAreBytesWithNulsAndMayBeEmpty) {
  std::string bytes("\0a\0\xff\x01", 5);
  for (size_t n = 0; n < 7; ++n) {  // every base64 padding case
    std::string v = bytes.substr(0, n % 6) + std::string(n, '\0');
    ASSERT_TRUE(store_->set("k" + std::to_string(n), v, kT).ok());
    EXPECT_EQ(*store_->get("k" + std::to_string(n), kT, IfAbsent::kFail), v);
  }
  ASSERT_TRUE(store_->set("empty", "", kT).ok());
  auto e = store_->get("empty", kT, IfAbsent::kFail);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_EQ(*e, "");
}

TEST_F(EtcdStoreTest, PrefixesKeepRunsApart) {
  auto other = cluster_->store("another-run/");
  ASSERT_TRUE(store_->set("x", "mine", kT).ok());
  EXPECT_EQ(other->get("x", kT, IfAbsent::kFail).status().code(), StatusCode::kNotFound);
}

TEST_F(EtcdStoreTest, WaitingGetIsSatisfiedByAnotherThreadsSet) {
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(200));
    EXPECT_TRUE(store_->set("late", "here", kT).ok());
  });
  auto v = store_->get("late", kT, IfAbsent::kWait);
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, "here");
}

TEST_F(EtcdStoreTest, WaitingGetTimesOut) {
  auto t0 = Clock::now();
  auto v = store_->get("never", milliseconds(300), IfAbsent::kWait);
  auto took = Clock::now() - t0;
  EXPECT_EQ(v.status().code(), StatusCode::kTimeout);
  EXPECT_GE(took, milliseconds(290));
  EXPECT_LT(took, milliseconds(800));
}

TEST_F(EtcdStoreTest, CompareSetFirstWriterWinsAcrossThreads) {
  constexpr int kThreads = 8;
  std::vector<std::string> got(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      ++ready;
      while (ready.load() < kThreads) std::this_thread::yield();
      auto r = store_->compare_set("winner", "", "t" + std::to_string(i), kT);
      got[i] = r.ok() ? *r : "error: " + r.status().to_string();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(got[i], got[0]);
  EXPECT_EQ(got[0].rfind("t", 0), 0u) << got[0];
  EXPECT_EQ(*store_->get("winner", kT, IfAbsent::kFail), got[0]);
}

TEST_F(EtcdStoreTest, CompareSetSwapsOnlyTheExpectedValue) {
  EXPECT_EQ(store_->compare_set("absent", "x", "y", kT).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(*store_->compare_set("c", "", "1", kT), "1");
  EXPECT_EQ(*store_->compare_set("c", "0", "2", kT), "1");  // lost: the value is 1
  EXPECT_EQ(*store_->compare_set("c", "1", "2", kT), "2");
  EXPECT_EQ(*store_->compare_set("c", "1", "2", kT), "2");  // a retry sees its own value
  std::string nul("\0z", 2);
  EXPECT_EQ(*store_->compare_set("c", "2", nul, kT), nul);
  EXPECT_EQ(*store_->compare_set("c", nul, "3", kT), "3");
}

TEST_F(EtcdStoreTest, ConnectStoreSelectsByUrl) {
  auto s = connect_store(cluster_->store_url("connect/"));
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  ASSERT_TRUE((*s)->set("k", "v", kT).ok());
  auto direct = cluster_->store("connect/");
  EXPECT_EQ(*direct->get("k", kT, IfAbsent::kFail), "v");
  auto mem = connect_store("memory://");
  ASSERT_TRUE(mem.ok());
  EXPECT_EQ(connect_store("tcp://user:secret@h:1").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(connect_store("tcp://user:secret@h:1").status().message().find("secret"),
            std::string::npos);
}

TEST(EtcdOptionsTest, ParsesUrlsAndValidates) {
  auto o = EtcdOptions::from_url("etcds://alice@h1:2379,h2:2380/job42/?ca=/c%20a.pem&cert=c&key=k");
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_TRUE(o->tls);
  EXPECT_EQ(o->endpoints, (std::vector<std::string>{"h1:2379", "h2:2380"}));
  EXPECT_EQ(o->prefix, "job42/");
  EXPECT_EQ(o->user, "alice");
  EXPECT_EQ(o->ca_file, "/c a.pem");
  EXPECT_EQ(o->validate().code(), StatusCode::kInvalidArgument);  // no password yet
  o->password = "pw";
  EXPECT_TRUE(o->validate().ok());

  auto with_pw = EtcdOptions::from_url("etcd://alice:pw@h1:2379/");
  EXPECT_EQ(with_pw.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(with_pw.status().message().find("pw@"), std::string::npos);
  EXPECT_FALSE(EtcdOptions::from_env("etcds://h1:2379/").ok());         // TLS without a CA
  EXPECT_FALSE(EtcdOptions::from_env("etcd://h1/").ok());               // no port
  EXPECT_FALSE(EtcdOptions::from_env("etcd:///x").ok());                // no endpoint
  EXPECT_FALSE(EtcdOptions::from_env("etcd://h1:2379/?bogus=1").ok());  // unknown option
  EXPECT_FALSE(EtcdOptions::from_env("etcd://h:1/?cert=c").ok());       // cert without key

  setenv("RESILIENT_ETCD_PASSWORD", "s3cret", 1);
  auto env = EtcdOptions::from_env("etcd://bob@h1:2379/p/");
  unsetenv("RESILIENT_ETCD_PASSWORD");
  ASSERT_TRUE(env.ok()) << env.status().to_string();
  EXPECT_EQ(env->password, "s3cret");
  auto missing = EtcdOptions::from_env("etcd://bob@h1:2379/p/");
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
}

// A cluster of one member per test, holding k = v, for the tests that kill or freeze it.
class EtcdOneMemberFailureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    require_etcd();
    c_ = std::make_unique<EtcdCluster>(1);
    ASSERT_GE(c_->wait_leader(), 0) << "etcd did not start";
    store_ = c_->store(
        std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "/");
    ASSERT_TRUE(store_->set("k", "v", kT).ok());
  }
  std::unique_ptr<EtcdCluster> c_;
  std::unique_ptr<EtcdStore> store_;
};

TEST_F(EtcdOneMemberFailureTest, KilledServerIsUnavailableWithinTheTimeout) {
  c_->kill_member(0);
  for (IfAbsent mode : {IfAbsent::kFail, IfAbsent::kWait}) {
    auto t0 = Clock::now();
    auto v = store_->get("k", seconds(2), mode);
    EXPECT_EQ(v.status().code(), StatusCode::kUnavailable) << v.status().to_string();
    EXPECT_LT(Clock::now() - t0, milliseconds(2500));
  }
  EXPECT_EQ(store_->set("k", "v", seconds(1)).code(), StatusCode::kUnavailable);
  EXPECT_EQ(store_->compare_set("k", "", "v", seconds(1)).status().code(),
            StatusCode::kUnavailable);
}

TEST_F(EtcdOneMemberFailureTest, FrozenServerTimesOut) {
  ASSERT_TRUE(c_->freeze_member(0));
  auto t0 = Clock::now();
  auto v = store_->get("k", milliseconds(1500), IfAbsent::kFail);
  auto took = Clock::now() - t0;
  EXPECT_EQ(v.status().code(), StatusCode::kTimeout) << v.status().to_string();
  EXPECT_GE(took, milliseconds(1400));
  EXPECT_LT(took, milliseconds(2200));
  auto cs = store_->compare_set("k", "v", "w", milliseconds(600));
  EXPECT_EQ(cs.status().code(), StatusCode::kTimeout) << cs.status().to_string();
  c_->signal_member(0, SIGCONT);
  auto after = store_->get("k", kT, IfAbsent::kFail);
  ASSERT_TRUE(after.ok()) << after.status().to_string();
  // A timed-out compare_set may still apply: the frozen server reads the requests queued on its
  // socket when it resumes, possibly after this read. Either way the swap is whole.
  EXPECT_TRUE(*after == "v" || *after == "w") << *after;
  std::string now = *after;
  for (int i = 0; i < 3 && now != "x"; ++i) now = *store_->compare_set("k", now, "x", kT);
  EXPECT_EQ(now, "x");
}

TEST(EtcdStoreFailureTest, ThreeMembersSurviveTheLeadersDeathAndAMinorityDoesNotDecide) {
  require_etcd();
  EtcdCluster c(3);
  int leader = c.wait_leader();
  ASSERT_GE(leader, 0);
  // The leader is the store's first endpoint, so its death is both a refused connection and an
  // election.
  auto store = c.store("cluster/", leader);
  ASSERT_TRUE(store->set("before", "1", kT).ok());
  c.kill_member(leader);
  auto t0 = Clock::now();
  auto v = store->get("before", kT, IfAbsent::kFail);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, "1");
  ASSERT_TRUE(store->set("after", "2", kT).ok());
  EXPECT_EQ(*store->compare_set("cas", "", "x", kT), "x");
  EXPECT_LT(Clock::now() - t0, kT);
  // One member left of three: no quorum, no answer (a minority does not decide).
  int second = -1;
  for (int i = 0; i < 3; ++i) {
    if (i != leader) {
      second = i;
      break;
    }
  }
  c.kill_member(second);
  auto lost = store->compare_set("cas2", "", "y", milliseconds(1500));
  EXPECT_EQ(lost.status().code(), StatusCode::kTimeout) << lost.status().to_string();
}

TEST(EtcdStoreSecurityTest, UserAuthenticationWithoutLeakingThePassword) {
  require_etcd();
  EtcdCluster c(1, false, {"--auth-token-ttl", "1"});  // tokens expire after 1 s idle
  ASSERT_GE(c.wait_leader(), 0);
  int port = c.client_port(0);
  post(port, "/v3/auth/role/add", R"({"name": "root"})");
  post(port, "/v3/auth/user/add", R"({"name": "root", "password": "pw-123"})");
  post(port, "/v3/auth/user/grant", R"({"user": "root", "role": "root"})");
  ASSERT_TRUE(post(port, "/v3/auth/enable").contains("header")) << "auth enable failed";

  setenv("RESILIENT_ETCD_PASSWORD", "pw-123", 1);
  auto good = connect_store(c.store_url("auth/").replace(0, 7, "etcd://root@"));
  setenv("RESILIENT_ETCD_PASSWORD", "wrong-pw", 1);
  auto bad = connect_store(c.store_url("auth/").replace(0, 7, "etcd://root@"));
  unsetenv("RESILIENT_ETCD_PASSWORD");
  ASSERT_TRUE(good.ok() && bad.ok());
  ASSERT_TRUE((*good)->set("a", "1", kT).ok());
  EXPECT_EQ(*(*good)->get("a", kT, IfAbsent::kFail), "1");
  EXPECT_EQ(*(*good)->compare_set("b", "", "x", kT), "x");
  std::this_thread::sleep_for(milliseconds(2500));  // the token expired: renewed once
  auto* etcd = dynamic_cast<EtcdStore*>(good->get());
  size_t before = etcd->requests();
  auto renewed = (*good)->get("a", kT, IfAbsent::kFail);
  ASSERT_TRUE(renewed.ok()) << renewed.status().to_string();
  EXPECT_EQ(*renewed, "1");
  EXPECT_EQ(etcd->requests() - before, 3u);  // refused, authenticate, the range again

  auto refused = (*bad)->set("b", "1", kT);
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.to_string();
  EXPECT_EQ(refused.to_string().find("wrong-pw"), std::string::npos) << refused.to_string();
  auto anonymous = c.store("auth/")->get("a", kT, IfAbsent::kFail);
  EXPECT_EQ(anonymous.status().code(), StatusCode::kFailedPrecondition)
      << anonymous.status().to_string();
}

TEST(EtcdStoreSecurityTest, TlsWithClientCertificates) {
  require_etcd();
  EtcdCluster c(1, /*tls=*/true);
  std::string d = c.dir().string();
  std::string url = "etcds://127.0.0.1:" + std::to_string(c.client_port(0)) + "/tls/?ca=" + d +
                    "/ca.pem&cert=" + d + "/client.pem&key=" + d + "/client.key";
  auto store = connect_store(url);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  Status st;
  for (auto end = Clock::now() + seconds(20); Clock::now() < end;) {  // until etcd serves
    st = (*store)->set("a", "1", seconds(1));
    if (st.ok()) break;
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(*(*store)->get("a", kT, IfAbsent::kFail), "1");
  // Without the client certificate the server refuses the handshake.
  auto no_cert = connect_store("etcds://127.0.0.1:" + std::to_string(c.client_port(0)) +
                               "/tls/?ca=" + d + "/ca.pem");
  ASSERT_TRUE(no_cert.ok());
  EXPECT_FALSE((*no_cert)->get("a", seconds(1), IfAbsent::kFail).ok());
}

}  // namespace
}  // namespace resilient
