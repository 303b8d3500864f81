#pragma once
// A fixed-size thread pool. Components take a ThreadPool& so tests and users can inject their
// own; default_thread_pool() is the shared default (RESILIENT_THREADS workers, default 4).

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "resilient/common/status.hpp"

namespace resilient {

/// How a background thread sets itself up when it starts.
struct ThreadSetup {
  /// Names the thread (<= 15 characters), as seen in top -H, gdb and crash reports.
  const char* name = "rs-pool";
  /// > 0 lowers its scheduling priority, so the training thread wins contended cores.
  int nice = 0;
  /// Non-empty: the CPUs it may run on (keeps background work off the training thread's cores).
  std::vector<int> cpus;
};

/// Applies `setup` to the calling thread. A failed pin is logged once, not fatal.
void apply_thread_setup(const ThreadSetup& setup);

/// Parses a CPU list such as "8-15" or "0,2,4-7" (empty: no CPUs, meaning unpinned).
/// Errors: InvalidArgument naming the bad part.
Result<std::vector<int>> parse_cpu_list(std::string_view text);

class ThreadPool {
 public:
  /// Each worker applies `setup` (name, priority, CPUs) when it starts.
  explicit ThreadPool(size_t threads, ThreadSetup setup = {});
  /// Finishes queued tasks, then joins the workers.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size(); }

  /// Runs `fn` on a worker; the future carries its result or exception.
  template <typename F>
  auto submit(F&& fn) -> std::future<decltype(fn())> {
    using R = decltype(fn());
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    auto fut = task->get_future();
    enqueue([task] { (*task)(); });
    return fut;
  }

  /// Calls fn(i) for i in [0, n) across the workers and the calling thread; returns when all
  /// are done. Exceptions propagate (the first one).
  void parallel_for(size_t n, const std::function<void(size_t)>& fn);

 private:
  void enqueue(std::function<void()> task);
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

/// Names the calling thread (truncated to the kernel's 15 characters), so a stack dump or a
/// crash report says which of resilient's threads it is.
void set_thread_name(const char* name);

/// The process-wide default pool, created on first use.
ThreadPool& default_thread_pool();

}  // namespace resilient
