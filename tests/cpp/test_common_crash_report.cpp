#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "resilient/common/crash_report.hpp"

namespace resilient {
namespace {

// The child dies from the signal, or (under ASan, whose handler comes after ours) exits non-zero.
bool died(int status) {
  return WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
}

class CrashReport : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(CrashReport, NamesSignalThreadAndFrames) {
  EXPECT_EXIT(
      {
        install_crash_handler();
        ::raise(SIGSEGV);
      },
      died, "resilient: fatal signal 11 \\(SIGSEGV\\), address 0x[0-9a-f]+, thread [0-9]+ ");
}

TEST_F(CrashReport, NamesTheNativeThreadThatCrashed) {
  EXPECT_EXIT(
      {
        install_crash_handler();
        std::thread t([] {
          pthread_setname_np(pthread_self(), "nccl-proxy-42");
          ::raise(SIGBUS);
        });
        t.join();
      },
      died, "fatal signal 7 \\(SIGBUS\\).*\"nccl-proxy-42\"");
}

TEST_F(CrashReport, RealFaultStillKillsWithTheSameSignal) {
  EXPECT_EXIT(
      {
        install_crash_handler();
        volatile int* volatile p = nullptr;
        *p = 1;  // a real fault: the handler returns, the instruction faults again
      },
      died, "fatal signal 11 \\(SIGSEGV\\), address 0x0,");
}

void previous_handler(int, siginfo_t*, void*) {
  const char msg[] = "previous handler ran\n";
  [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
  ::_exit(42);
}

TEST_F(CrashReport, HandsTheSignalToThePreviousHandler) {
  EXPECT_EXIT(
      {
        struct sigaction sa {};
        sa.sa_sigaction = previous_handler;
        sa.sa_flags = SA_SIGINFO;
        ::sigaction(SIGABRT, &sa, nullptr);
        install_crash_handler();
        install_crash_handler();  // idempotent: the previous handler is still the one above
        std::abort();
      },
      ::testing::ExitedWithCode(42), "fatal signal 6 \\(SIGABRT\\)(.|\n)*previous handler ran");
}

}  // namespace
}  // namespace resilient
