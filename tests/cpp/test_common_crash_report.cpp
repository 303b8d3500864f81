#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
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

TEST_F(CrashReport, RealFaultReportsTheAddressAndStillDies) {
  // A write to a PROT_NONE page at a fixed address (the death test re-executes this binary, so
  // the address must not depend on the parent): a fault sanitizers cannot intercept beforehand.
  EXPECT_EXIT(
      {
        void* want = reinterpret_cast<void*>(0x5e5e00000000ULL);
        void* page =
            ::mmap(want, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
        if (page != want) ::_exit(3);
        install_crash_handler();
        *static_cast<volatile int*>(page) = 1;  // the handler returns, the write faults again
      },
      died, "fatal signal 11 \\(SIGSEGV\\), address 0x5e5e00000000,");
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
