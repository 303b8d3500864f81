#include "resilient/common/thread_pool.hpp"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <exception>

#include "resilient/common/config.hpp"

namespace resilient {

void lower_thread_priority(int nice) {
  if (nice > 0) (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), nice);
}

void set_thread_name(const char* name) {
  char buf[16] = {};
  std::strncpy(buf, name, sizeof(buf) - 1);
  (void)::pthread_setname_np(::pthread_self(), buf);
}

ThreadPool::ThreadPool(size_t threads, int nice, const char* name) {
  if (threads == 0) threads = 1;
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    workers_.emplace_back([this, nice, name] {
      set_thread_name(name);
      lower_thread_priority(nice);
      run();
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  std::atomic<size_t> next{0};
  std::mutex err_mu;
  std::exception_ptr error;
  auto body = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(err_mu);
        if (!error) error = std::current_exception();
      }
    }
  };
  size_t helpers = std::min(n - 1, workers_.size());
  std::vector<std::future<void>> futs;
  futs.reserve(helpers);
  for (size_t i = 0; i < helpers; ++i) futs.push_back(submit(body));
  body();
  for (auto& f : futs) f.get();
  if (error) std::rethrow_exception(error);
}

ThreadPool& default_thread_pool() {
  static ThreadPool* pool = new ThreadPool(static_cast<size_t>(env_int("RESILIENT_THREADS", 4)));
  return *pool;
}

}  // namespace resilient
