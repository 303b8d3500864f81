// Live detector agents over real UDP sockets on the loopback interface: three ranks heartbeat
// each other, the owner's thread pokes every public method while the network and store threads
// run (the ThreadSanitizer build runs this), and a rank that stops is removed by a generation
// the others agree on. Bounded: a few seconds when healthy, 20 s at most.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "resilient/detect/agent.hpp"

namespace resilient::detect {
namespace {

using namespace std::chrono_literals;

std::vector<std::unique_ptr<Agent>> start_agents(int n, const std::shared_ptr<Store>& store) {
  auto g0 = std::make_shared<const Generation>(Generation::initial(n));
  std::vector<std::unique_ptr<Agent>> agents;
  for (int r = 0; r < n; ++r) {
    AgentOptions o;
    o.core.rank = r;
    o.core.world_size = n;
    o.core.heartbeat_interval = 50ms;
    o.core.max_silence = 1500ms;
    o.hang_watchdog = false;
    o.job = "live-test";
    o.key = "0123456789abcdef-live";
    o.addresses.assign(n, "127.0.0.1:0");  // each binds its own; real ports are set below
    o.poll_interval = 5ms;
    auto a = Agent::create(o, store, g0);
    EXPECT_TRUE(a.ok()) << a.status().to_string();
    if (!a.ok()) return {};
    agents.push_back(std::move(a).value());
  }
  std::vector<std::string> addresses;
  for (auto& a : agents) addresses.push_back("127.0.0.1:" + std::to_string(a->port()));
  for (auto& a : agents) EXPECT_TRUE(a->set_addresses(addresses).ok());
  for (auto& a : agents) EXPECT_TRUE(a->start().ok());
  return agents;
}

TEST(DetectAgentLive, HealthyRanksHeartbeatAndAStoppedRankIsRemoved) {
  auto store = std::make_shared<InMemoryStore>();
  auto agents = start_agents(3, store);
  ASSERT_EQ(agents.size(), 3u);

  // Healthy: the owner's calls race the agents' threads; nobody is suspected.
  const auto healthy_until = std::chrono::steady_clock::now() + 1s;
  uint64_t step = 0;
  while (std::chrono::steady_clock::now() < healthy_until) {
    for (auto& a : agents) {
      a->set_step(++step);
      a->enter_section("forward");
      a->leave_section();
      (void)a->metrics();
      for (const Event& e : a->poll_events(5ms)) {
        EXPECT_NE(e.kind, Event::Kind::kConfirm) << "rank " << e.rank << ": " << e.detail;
        EXPECT_NE(e.kind, Event::Kind::kGeneration);
      }
    }
  }
  for (auto& a : agents) {
    AgentMetrics m = a->metrics();
    EXPECT_GT(m.wire.received, 0u);
    EXPECT_EQ(m.wire.dropped_bad_mac, 0u);
    EXPECT_EQ(m.live, 3u);
  }

  // Rank 2 stops (its socket closes): ranks 0 and 1 decide a generation without it.
  agents[2].reset();
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  std::vector<bool> removed(2, false);
  while ((!removed[0] || !removed[1]) && std::chrono::steady_clock::now() < deadline) {
    for (int r = 0; r < 2; ++r) {
      for (const Event& e : agents[r]->poll_events(20ms)) {
        if (e.kind != Event::Kind::kGeneration) continue;
        for (const Verdict& v : e.removed) removed[r] = removed[r] || v.rank == 2;
      }
    }
  }
  EXPECT_TRUE(removed[0] && removed[1]) << "rank 2 not removed within 20 s";
  for (int r = 0; r < 2; ++r) {
    GenerationPtr g = agents[r]->generation();
    ASSERT_TRUE(g);
    EXPECT_FALSE(g->contains(2));
    EXPECT_TRUE(g->contains(0) && g->contains(1));
  }
  for (auto& a : agents) {
    if (a) a->stop();
  }
}

}  // namespace
}  // namespace resilient::detect
