#include "resilient/common/crash_report.hpp"

#include <execinfo.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <mutex>

namespace resilient {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
constexpr int kMaxFrames = 64;

struct Previous {
  int signal;
  struct sigaction action;
};
Previous g_previous[std::size(kSignals)];
std::once_flag g_once;

// Only write(2) below: snprintf and malloc are not async-signal-safe.
void put(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void put_number(uint64_t v, unsigned base) {
  char buf[24];
  char* p = buf + sizeof(buf) - 1;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[v % base];
    v /= base;
  } while (v != 0 && p > buf);
  if (base == 16) put("0x");
  put(p);
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGILL:
      return "SIGILL";
    case SIGFPE:
      return "SIGFPE";
    case SIGABRT:
      return "SIGABRT";
  }
  return "?";
}

void handle(int sig, siginfo_t* info, void* /*context*/) {
  const int saved_errno = errno;
  put("resilient: fatal signal ");
  put_number(static_cast<uint64_t>(sig), 10);
  put(" (");
  put(signal_name(sig));
  put(")");
  if (sig != SIGABRT && info != nullptr) {
    put(", address ");
    put_number(reinterpret_cast<uintptr_t>(info->si_addr), 16);
  }
  put(", thread ");
  put_number(static_cast<uint64_t>(::syscall(SYS_gettid)), 10);
  char name[17] = {};
  if (::prctl(PR_GET_NAME, name, 0, 0, 0) == 0) {
    put(" \"");
    put(name);
    put("\"");
  }
  put("\n");
  void* frames[kMaxFrames];
  const int n = ::backtrace(frames, kMaxFrames);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);

  // Hand the signal on by putting the previous action back (a handler such as Python's
  // faulthandler, which prints more, or the default action) and letting it see the signal again:
  // a fault (si_code > 0) recurs when the instruction is re-executed on return; a sent signal
  // (kill, raise, abort) is raised again, and delivered on return since it is blocked meanwhile.
  for (const Previous& p : g_previous) {
    if (p.signal == sig) ::sigaction(sig, &p.action, nullptr);
  }
  errno = saved_errno;
  if (info == nullptr || info->si_code <= 0) ::raise(sig);
}

}  // namespace

void install_crash_handler() {
  std::call_once(g_once, [] {
    // backtrace() loads libgcc on its first call, which allocates: do it now, not in the handler.
    void* warm[1];
    ::backtrace(warm, 1);
    struct sigaction sa {};
    sa.sa_sigaction = handle;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    ::sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kSignals); ++i) {
      g_previous[i].signal = kSignals[i];
      ::sigaction(kSignals[i], &sa, &g_previous[i].action);
    }
  });
}

}  // namespace resilient
