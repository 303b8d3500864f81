#include "resilient/common/thread_pool.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "resilient/common/config.hpp"
#include "resilient/common/logging.hpp"

namespace resilient {

namespace {

// Lowers the calling thread's scheduling priority by `nice` (no-op for nice <= 0).
void lower_thread_priority(int nice) {
  if (nice > 0) (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), nice);
}

}  // namespace

void set_thread_name(const char* name) {
  char buf[16] = {};
  std::strncpy(buf, name, sizeof(buf) - 1);
  (void)::pthread_setname_np(::pthread_self(), buf);
}

void apply_thread_setup(const ThreadSetup& setup) {
  set_thread_name(setup.name);
  lower_thread_priority(setup.nice);
  if (setup.cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : setup.cpus) CPU_SET(cpu, &set);
  if (::sched_setaffinity(0, sizeof(set), &set) != 0) {
    log_once(std::string("pin:") + setup.name, LogLevel::kWarn,
             std::string("cannot pin ") + setup.name + " threads to the given CPUs (" +
                 std::strerror(errno) + "); they run unpinned");
  }
}

Result<std::vector<int>> parse_cpu_list(std::string_view text) {
  std::vector<int> cpus;
  auto bad = [&](std::string_view part) {
    return Status(StatusCode::kInvalidArgument, "CPU list '" + std::string(text) + "': bad part '" +
                                                    std::string(part) +
                                                    "' (expected e.g. 8-15 or 0,2,4-7)");
  };
  auto number = [](std::string_view s, int& out) {
    if (s.empty() || s.size() > 5) return false;
    out = 0;
    for (char ch : s) {
      if (ch < '0' || ch > '9') return false;
      out = out * 10 + (ch - '0');
    }
    return out < CPU_SETSIZE;
  };
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    std::string_view part =
        text.substr(start, comma == std::string_view::npos ? text.size() - start : comma - start);
    size_t dash = part.find('-');
    int lo = 0, hi = 0;
    if (dash == std::string_view::npos) {
      if (!number(part, lo)) return bad(part);
      hi = lo;
    } else if (!number(part.substr(0, dash), lo) || !number(part.substr(dash + 1), hi) || hi < lo) {
      return bad(part);
    }
    for (int cpu = lo; cpu <= hi; ++cpu) cpus.push_back(cpu);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
    if (start == text.size()) return bad("");  // trailing comma
  }
  return cpus;
}

ThreadPool::ThreadPool(size_t threads, ThreadSetup setup) {
  if (threads == 0) threads = 1;
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    workers_.emplace_back([this, setup] {
      apply_thread_setup(setup);
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

namespace {

// RESILIENT_THREADS, or 4; a malformed value or one outside [1, 1024] throws
// std::invalid_argument naming the variable (0 or a negative count is not "automatic").
size_t default_pool_threads() {
  const int64_t n = env_int("RESILIENT_THREADS", 4);
  if (n < 1 || n > 1024) {
    throw std::invalid_argument("RESILIENT_THREADS must be in [1, 1024], got " + std::to_string(n));
  }
  return static_cast<size_t>(n);
}

}  // namespace

ThreadPool& default_thread_pool() {
  static ThreadPool* pool = new ThreadPool(default_pool_threads());
  return *pool;
}

}  // namespace resilient
