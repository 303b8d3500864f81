#pragma once
// A fixed-size thread pool. Components take a ThreadPool& so tests and users can inject their
// own; default_thread_pool() is the shared default (RESILIENT_THREADS workers, default 4).

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace resilient {

class ThreadPool {
 public:
  /// `nice` > 0 lowers the workers' scheduling priority (setpriority on each thread), for
  /// background work that must not slow the training thread when cores are contended.
  /// `name` (<= 15 characters) names the workers, as seen in top -H, gdb and crash reports.
  explicit ThreadPool(size_t threads, int nice = 0, const char* name = "rs-pool");
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

/// Lowers the calling thread's scheduling priority by `nice` (no-op for nice <= 0).
void lower_thread_priority(int nice);

/// Names the calling thread (truncated to the kernel's 15 characters), so a stack dump or a
/// crash report says which of resilient's threads it is.
void set_thread_name(const char* name);

/// The process-wide default pool, created on first use.
ThreadPool& default_thread_pool();

}  // namespace resilient
