#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>

#include "resilient/io/fault_env.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::io {
namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/resilient-fault-XXXXXX";
  return ::mkdtemp(tmpl);
}

TEST(FaultEnv, UnsetMeansNoFault) {
  ::unsetenv("RESILIENT_FAULT_OPS");
  auto spec = fault_spec_from_env();
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec.value().ops, 0u);
}

TEST(FaultEnv, ParsesEveryVariable) {
  ::setenv("RESILIENT_FAULT_OPS", "write,fsync", 1);
  ::setenv("RESILIENT_FAULT_ERRNO", "ENOSPC", 1);
  ::setenv("RESILIENT_FAULT_PATH", "step-", 1);
  ::setenv("RESILIENT_FAULT_AFTER", "2", 1);
  ::setenv("RESILIENT_FAULT_COUNT", "3", 1);
  ::setenv("RESILIENT_FAULT_TRIGGER", "/tmp/x", 1);
  ::setenv("RESILIENT_FAULT_DELAY_MS", "1.5", 1);
  auto spec = fault_spec_from_env();
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  EXPECT_EQ(spec.value().ops,
            (1u << static_cast<int>(FileOp::kWrite)) | (1u << static_cast<int>(FileOp::kFsync)));
  EXPECT_EQ(spec.value().error, ENOSPC);
  EXPECT_EQ(spec.value().path_contains, "step-");
  EXPECT_EQ(spec.value().after, 2);
  EXPECT_EQ(spec.value().count, 3);
  EXPECT_EQ(spec.value().trigger_file, "/tmp/x");
  EXPECT_DOUBLE_EQ(spec.value().delay_ms, 1.5);
  ::setenv("RESILIENT_FAULT_ERRNO", "EBOGUS", 1);
  EXPECT_FALSE(fault_spec_from_env().ok());
  ::setenv("RESILIENT_FAULT_ERRNO", "5", 1);
  ::setenv("RESILIENT_FAULT_OPS", "write,teleport", 1);
  EXPECT_FALSE(fault_spec_from_env().ok());
  for (const char* k : {"OPS", "ERRNO", "PATH", "AFTER", "COUNT", "TRIGGER", "DELAY_MS"})
    ::unsetenv((std::string("RESILIENT_FAULT_") + k).c_str());
}

TEST(FaultEnv, FailsMatchingWritesAfterAndCount) {
  const std::string dir = temp_dir();
  FaultSpec spec;
  spec.ops = 1u << static_cast<int>(FileOp::kWrite);
  spec.error = EIO;
  spec.path_contains = "victim";
  spec.after = 1;
  spec.count = 2;
  ASSERT_TRUE(install_fault_hook(spec).ok());
  int fd = sys::open((dir + "/victim").c_str(), O_CREAT | O_WRONLY);
  int other = sys::open((dir + "/bystander").c_str(), O_CREAT | O_WRONLY);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(sys::pwrite(other, "x", 1, 0), 1);  // path does not match
  EXPECT_EQ(sys::pwrite(fd, "x", 1, 0), 1);     // the first matching call passes (after=1)
  EXPECT_EQ(sys::pwrite(fd, "x", 1, 0), -1);
  EXPECT_EQ(errno, EIO);
  EXPECT_EQ(sys::pwrite(fd, "x", 1, 0), -1);
  EXPECT_EQ(sys::pwrite(fd, "x", 1, 0), 1);  // count=2 exhausted
  EXPECT_EQ(fault_hook_hits(), 2);
  // Replacing the hook is allowed; clearing returns the hits.
  ASSERT_TRUE(install_fault_hook(spec).ok());
  EXPECT_EQ(clear_fault_hook(), 0);
  EXPECT_EQ(sys::pwrite(fd, "x", 1, 0), 1);
  sys::close(fd);
  sys::close(other);
}

TEST(FaultEnv, TriggerFileGatesTheFault) {
  const std::string dir = temp_dir();
  const std::string trigger = dir + "/go";
  FaultSpec spec;
  spec.ops = 1u << static_cast<int>(FileOp::kFsync);
  spec.error = EIO;
  spec.trigger_file = trigger;
  ASSERT_TRUE(install_fault_hook(spec).ok());
  int fd = sys::open((dir + "/f").c_str(), O_CREAT | O_WRONLY);
  EXPECT_EQ(sys::fsync(fd), 0);
  std::FILE* f = std::fopen(trigger.c_str(), "w");
  std::fclose(f);
  EXPECT_EQ(sys::fsync(fd), -1);
  EXPECT_EQ(errno, EIO);
  ::unlink(trigger.c_str());
  EXPECT_EQ(sys::fsync(fd), 0);
  EXPECT_EQ(clear_fault_hook(), 1);
  sys::close(fd);
}

TEST(FaultEnv, RefusesWhileATestHookIsInstalled) {
  ScopedFileHook hook([](FileOp, const std::string&) { return 0; });
  FaultSpec spec;
  spec.ops = 1;
  auto st = install_fault_hook(spec);
  EXPECT_FALSE(st.ok());
  clear_fault_hook();
}

}  // namespace
}  // namespace resilient::io
