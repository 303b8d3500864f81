#include "resilient/detect/agent.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "resilient/common/logging.hpp"
#include "resilient/common/thread_pool.hpp"

namespace resilient::detect {
namespace {

Result<sockaddr_in> parse_addr(const std::string& text) {
  size_t colon = text.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (colon == std::string::npos) return Status(StatusCode::kInvalidArgument, "no port in " + text);
  std::string host = text.substr(0, colon);
  int port = std::atoi(text.c_str() + colon + 1);
  if (port < 0 || port > 65535 || inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    return Status(StatusCode::kInvalidArgument, "not an ipv4:port address: " + text);
  }
  sa.sin_port = htons(static_cast<uint16_t>(port));
  return sa;
}

std::string addr_bytes(const sockaddr_in& sa) {
  return std::string(reinterpret_cast<const char*>(&sa), sizeof sa);
}

}  // namespace

Result<std::unique_ptr<Agent>> Agent::create(AgentOptions opt, std::shared_ptr<Store> store,
                                             GenerationPtr initial) {
  const int32_t rank = opt.core.rank;
  RESILIENT_RETURN_IF_ERROR(opt.core.validate());
  RESILIENT_RETURN_IF_ERROR(opt.watchdog.validate());
  if (opt.key.size() < 16)
    return Status(StatusCode::kInvalidArgument, "HMAC key shorter than 16 bytes");
  if (rank < 0 || static_cast<size_t>(rank) >= opt.addresses.size()) {
    return Status(StatusCode::kInvalidArgument, "rank outside the address list");
  }
  if (!store || !initial)
    return Status(StatusCode::kInvalidArgument, "store and generation required");
  RESILIENT_ASSIGN_OR_RETURN(sockaddr_in self, parse_addr(opt.addresses[rank]));
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::from_errno(errno, "socket");
  if (::bind(fd, reinterpret_cast<sockaddr*>(&self), sizeof self) != 0) {
    int e = errno;
    ::close(fd);
    return Status::from_errno(e, "bind " + opt.addresses[rank]);
  }
  socklen_t len = sizeof self;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len);
  return std::unique_ptr<Agent>(
      new Agent(std::move(opt), std::move(store), std::move(initial), fd, ntohs(self.sin_port)));
}

Agent::Agent(AgentOptions opt, std::shared_ptr<Store> store, GenerationPtr initial, int fd,
             int port)
    : opt_(std::move(opt)),
      store_(std::move(store)),
      codec_(opt_.key, job_id(opt_.job), opt_.run_id),
      fd_(fd),
      port_(port),
      core_(opt_.core, initial, SteadyClock::instance().now()),
      watchdog_(opt_.watchdog, SteadyClock::instance().now()),
      reply_addr_(opt_.addresses.size()) {
  for (const std::string& a : opt_.addresses) {
    auto sa = parse_addr(a);
    addr_bytes_.push_back(sa.ok() ? addr_bytes(*sa) : std::string());
  }
}

Agent::~Agent() {
  stop();
  for (auto& [peer, fd] : watch_fds_) ::close(fd);
  ::close(fd_);
}

Status Agent::set_addresses(std::vector<std::string> addresses) {
  if (running_) return Status(StatusCode::kFailedPrecondition, "set_addresses after start");
  if (addresses.size() != static_cast<size_t>(opt_.core.world_size)) {
    return Status(StatusCode::kInvalidArgument, "need one address per rank");
  }
  std::vector<std::string> bytes;
  for (const std::string& a : addresses) {
    RESILIENT_ASSIGN_OR_RETURN(sockaddr_in sa, parse_addr(a));
    bytes.push_back(addr_bytes(sa));
  }
  std::lock_guard lock(mu_);
  opt_.addresses = std::move(addresses);
  addr_bytes_ = std::move(bytes);
  return ok_status();
}

Status Agent::start() {
  if (running_.exchange(true)) return Status(StatusCode::kFailedPrecondition, "already started");
  {
    std::lock_guard lock(mu_);
    // Silence and stall clocks start now, not when the agent was built (address exchange and
    // the start barrier can take seconds).
    TimePoint now = SteadyClock::instance().now();
    core_ = DetectorCore(opt_.core, core_.generation(), now);
    watchdog_ = HangWatchdog(opt_.watchdog, now);
    sync_watch_sockets();
  }
  net_thread_ = std::thread([this] {
    set_thread_name("rs-detect-net");
    net_loop();
  });
  store_thread_ = std::thread([this] {
    set_thread_name("rs-detect-store");
    store_loop();
  });
  return ok_status();
}

void Agent::stop() {
  if (!running_.exchange(false)) return;
  store_cv_.notify_all();
  if (net_thread_.joinable()) net_thread_.join();
  if (store_thread_.joinable()) store_thread_.join();
  ev_cv_.notify_all();
}

void Agent::enter_section(const std::string& name) {
  std::lock_guard lock(mu_);
  watchdog_.enter(name, SteadyClock::instance().now());
}

void Agent::leave_section() {
  std::lock_guard lock(mu_);
  watchdog_.leave(SteadyClock::instance().now());
}

std::vector<Event> Agent::poll_events(Duration timeout) {
  std::unique_lock lock(ev_mu_);
  ev_cv_.wait_for(lock, timeout, [&] { return !events_.empty() || !running_; });
  std::vector<Event> out(events_.begin(), events_.end());
  events_.clear();
  return out;
}

AgentMetrics Agent::metrics() {
  std::lock_guard lock(mu_);
  TimePoint now = SteadyClock::instance().now();
  return AgentMetrics{core_.counters(),
                      wire_,
                      core_.peer_stats(now),
                      core_.generation()->number,
                      core_.generation()->live.size(),
                      watchdog_.section(),
                      to_seconds(watchdog_.limit()),
                      watchdog_.step()};
}

GenerationPtr Agent::generation() {
  std::lock_guard lock(mu_);
  return core_.generation();
}

void Agent::sync_watch_sockets() {
  const auto& want = core_.watched();
  std::vector<std::pair<int32_t, int>> next;
  for (auto& [peer, fd] : watch_fds_) {
    if (std::find(want.begin(), want.end(), peer) != want.end())
      next.push_back({peer, fd});
    else
      ::close(fd);
  }
  for (int32_t peer : want) {
    bool have = std::any_of(next.begin(), next.end(), [&](auto& p) { return p.first == peer; });
    if (have || addr_bytes_[peer].empty()) continue;
    int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    // Same source IP as the published address, so the peer can check where pings come from.
    sockaddr_in local{};
    const auto& self = addr_bytes_[opt_.core.rank];
    if (self.size() == sizeof local) {
      std::memcpy(&local, self.data(), sizeof local);
      local.sin_port = 0;
    } else {
      local.sin_family = AF_INET;
    }
    const auto* sa = reinterpret_cast<const sockaddr*>(addr_bytes_[peer].data());
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&local), sizeof local) != 0 ||
        ::connect(fd, sa, sizeof(sockaddr_in)) != 0) {
      ::close(fd);
      continue;
    }
    next.push_back({peer, fd});
  }
  watch_fds_ = std::move(next);
}

void Agent::send_one(const Outgoing& o) {
  if (o.to < 0 || static_cast<size_t>(o.to) >= addr_bytes_.size()) return;
  std::string data = codec_.encode(o.msg);
  ssize_t rc = -1;
  if (o.msg.type == MsgType::kPing) {
    for (auto& [peer, fd] : watch_fds_) {
      if (peer == o.to) rc = ::send(fd, data.data(), data.size(), 0);
    }
  } else {
    const std::string& a = (o.msg.type == MsgType::kAck && !reply_addr_[o.to].empty())
                               ? reply_addr_[o.to]
                               : addr_bytes_[o.to];
    if (a.empty()) return;
    rc = ::sendto(fd_, data.data(), data.size(), 0, reinterpret_cast<const sockaddr*>(a.data()),
                  sizeof(sockaddr_in));
  }
  if (rc < 0) {
    ++wire_.send_errors;
    if (errno == ECONNREFUSED && o.msg.type == MsgType::kPing) {
      ++wire_.refused;
      core_.on_unreachable(o.to, SteadyClock::instance().now());
    }
  } else {
    ++wire_.sent;
  }
}

void Agent::handle_datagram(const char* data, size_t n, const void* from, unsigned from_len,
                            int32_t via_peer, TimePoint now) {
  DropReason why;
  auto msg = codec_.decode(std::string_view(data, n), &why);
  if (!msg.ok()) {
    switch (why) {
      case DropReason::kBadMac:
        ++wire_.dropped_bad_mac;
        break;
      case DropReason::kOtherJob:
        ++wire_.dropped_other_job;
        break;
      case DropReason::kOtherRun:
        ++wire_.dropped_other_run;
        break;
      case DropReason::kBadVersion:
        ++wire_.dropped_version;
        break;
      default:
        ++wire_.dropped_malformed;
        break;
    }
    return;
  }
  if (static_cast<size_t>(msg->from) >= addr_bytes_.size() ||
      (via_peer >= 0 && msg->from != via_peer)) {
    ++wire_.dropped_malformed;
    return;
  }
  // The sender must speak from the IP it published (its port differs: pings leave through a
  // connected socket of their own).
  const std::string& published = addr_bytes_[msg->from];
  if (from_len != sizeof(sockaddr_in) || published.size() != sizeof(sockaddr_in) ||
      static_cast<const sockaddr_in*>(from)->sin_addr.s_addr !=
          reinterpret_cast<const sockaddr_in*>(published.data())->sin_addr.s_addr) {
    ++wire_.dropped_unknown_source;
    return;
  }
  ++wire_.received;
  if (!core_.on_message(*msg, now)) return;  // replayed, stale or misdirected: no answer
  if (msg->type == MsgType::kPing) {
    reply_addr_[msg->from].assign(static_cast<const char*>(from), from_len);
  }
}

void Agent::pump(TimePoint now) {
  core_.set_step(step_.load(std::memory_order_relaxed));
  if (opt_.hang_watchdog) {
    watchdog_.progress(step_.load(std::memory_order_relaxed), now);
    if (auto hang = watchdog_.check(now)) {
      RESILIENT_LOG(kWarn, "detect: rank " << opt_.core.rank << " hang in " << hang->section
                                           << " after " << to_seconds(hang->stalled) << " s");
      core_.report_self(Verdict{opt_.core.rank, Reason::kHang, hang->section}, now);
    }
  }
  core_.tick(now);
  for (;;) {
    auto out = core_.take_outbox();
    if (out.empty()) break;
    for (const auto& o : out) send_one(o);  // may feed on_unreachable -> more output
  }
  sync_watch_sockets();  // O(watch_count) and syscall-free when the watch set is unchanged
  auto reqs = core_.take_store_requests();
  if (!reqs.empty()) {
    for (auto& r : reqs) store_queue_.push_back(std::move(r));
    store_cv_.notify_one();
  }
  auto evs = core_.take_events();
  if (!evs.empty()) {
    std::lock_guard lock(ev_mu_);
    for (auto& e : evs) {
      events_.push_back(std::move(e));
      if (events_.size() > opt_.max_events) events_.pop_front();
    }
    ev_cv_.notify_all();
  }
}

void Agent::net_loop() {
  std::vector<pollfd> fds;
  std::vector<int32_t> owners;
  char buf[kMaxDatagram + 1];
  const int poll_ms = std::max<int>(
      1, static_cast<int>(
             std::chrono::duration_cast<std::chrono::milliseconds>(opt_.poll_interval).count()));
  while (running_.load()) {
    fds.clear();
    owners.clear();
    {
      std::lock_guard lock(mu_);
      fds.push_back({fd_, POLLIN, 0});
      owners.push_back(-1);
      for (auto& [peer, fd] : watch_fds_) {
        fds.push_back({fd, POLLIN, 0});
        owners.push_back(peer);
      }
    }
    ::poll(fds.data(), fds.size(), poll_ms);
    std::lock_guard lock(mu_);
    TimePoint now = SteadyClock::instance().now();
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLERR))) continue;
      for (int budget = 0; budget < 256; ++budget) {
        sockaddr_in from{};
        socklen_t flen = sizeof from;
        ssize_t n =
            ::recvfrom(fds[i].fd, buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &flen);
        if (n < 0) {
          if (errno == ECONNREFUSED && owners[i] >= 0) {
            ++wire_.refused;
            core_.on_unreachable(owners[i], now);
            continue;
          }
          break;  // EAGAIN or a transient error
        }
        handle_datagram(buf, static_cast<size_t>(n), &from, flen, owners[i], now);
      }
    }
    pump(now);
  }
}

void Agent::store_loop() {
  while (true) {
    StoreRequest req;
    {
      std::unique_lock lock(mu_);
      store_cv_.wait_for(lock, std::chrono::milliseconds(200),
                         [&] { return !store_queue_.empty() || !running_.load(); });
      if (!running_.load()) return;
      if (store_queue_.empty()) continue;
      req = std::move(store_queue_.front());
      store_queue_.pop_front();
    }
    Result<Generation> result = Status(StatusCode::kInternal, "unset");
    if (req.kind == StoreRequest::Kind::kPropose) {
      result = decide_generation(*store_, opt_.store_prefix, req.proposal, opt_.store_timeout);
    } else {
      // Gossip only says that a generation exists; the record is the store's (a datagram from a
      // key holder must not be able to remove ranks). Records are self-contained (full live set).
      result = read_generation(*store_, opt_.store_prefix, req.number, opt_.store_timeout);
    }
    std::lock_guard lock(mu_);
    TimePoint now = SteadyClock::instance().now();
    if (result.ok()) {
      core_.on_generation(std::make_shared<const Generation>(std::move(result).value()), now);
    } else {
      RESILIENT_LOG(kInfo, "detect: store request for generation "
                               << req.number << " failed: " << result.status().to_string());
      core_.on_store_error(req, now);
    }
    pump(now);
  }
}

}  // namespace resilient::detect
