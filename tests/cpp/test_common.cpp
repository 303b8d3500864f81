#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>

#include "resilient/common/clock.hpp"
#include "resilient/common/config.hpp"
#include "resilient/common/status.hpp"

namespace resilient {
namespace {

Result<int> half(int x) {
  if (x % 2) return Status(StatusCode::kInvalidArgument, "odd");
  return x / 2;
}

Result<int> quarter(int x) {
  RESILIENT_ASSIGN_OR_RETURN(int h, half(x));
  return half(h);
}

TEST(Status, FromErrnoMapsNoSpaceAndKeepsContext) {
  Status s = Status::from_errno(ENOSPC, "write", "/ckpt/a");
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  s.with_offset(4096);
  EXPECT_NE(s.to_string().find("offset=4096"), std::string::npos);
  EXPECT_NE(s.to_string().find("file=/ckpt/a"), std::string::npos);
  EXPECT_EQ(Status::from_errno(EIO, "read").code(), StatusCode::kIoError);
}

TEST(Result, PropagatesErrorsThroughMacros) {
  EXPECT_EQ(*quarter(8), 2);
  auto r = quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THROW(r.value(), std::logic_error);
}

TEST(Check, ThrowsWithMessage) {
  try {
    RESILIENT_CHECK(1 + 1 == 3, "math is "
                                    << "broken");
    FAIL();
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("math is broken"), std::string::npos);
  }
}

TEST(Config, ParsesBytes) {
  EXPECT_EQ(*parse_bytes("4096"), 4096u);
  EXPECT_EQ(*parse_bytes("16MiB"), 16u << 20);
  EXPECT_EQ(*parse_bytes("4k"), 4096u);
  EXPECT_EQ(*parse_bytes("1.5GiB"), 3ull << 29);
  EXPECT_FALSE(parse_bytes("lots").ok());
  EXPECT_FALSE(parse_bytes("-1").ok());
  EXPECT_FALSE(parse_bytes("3 parsecs").ok());
}

TEST(Config, ParsesNumbersAndBooleansStrictly) {
  EXPECT_EQ(*parse_int(" -7 "), -7);
  EXPECT_FALSE(parse_int("7x").ok());
  EXPECT_FALSE(parse_int("").ok());
  EXPECT_FALSE(parse_int("99999999999999999999").ok());
  EXPECT_DOUBLE_EQ(*parse_double("1e3"), 1000.0);
  EXPECT_FALSE(parse_double("nan").ok());
  EXPECT_FALSE(parse_double("1.5s").ok());
  EXPECT_TRUE(*parse_bool("YES"));
  EXPECT_FALSE(*parse_bool("off"));
  EXPECT_FALSE(parse_bool("auto").ok());
  EXPECT_FALSE(parse_bool("garbage").ok());
}

TEST(Config, EnvOverridesAndRejectsGarbage) {
  setenv("RESILIENT_TEST_X", "12", 1);
  EXPECT_EQ(env_int("RESILIENT_TEST_X", 3), 12);
  setenv("RESILIENT_TEST_X", "12abc", 1);
  EXPECT_THROW(env_int("RESILIENT_TEST_X", 3), std::invalid_argument);
  unsetenv("RESILIENT_TEST_X");
  EXPECT_EQ(env_int("RESILIENT_TEST_X", 3), 3);
  setenv("RESILIENT_TEST_F", "OFF", 1);
  EXPECT_EQ(env_feature("RESILIENT_TEST_F", Feature::kAuto), Feature::kOff);
  unsetenv("RESILIENT_TEST_F");
}

TEST(Config, EnvValueNamesTheVariableInItsStatus) {
  unsetenv("RESILIENT_TEST_Y");
  EXPECT_DOUBLE_EQ(*env_value("RESILIENT_TEST_Y", 1.5, parse_double), 1.5);
  setenv("RESILIENT_TEST_Y", "2.5", 1);
  EXPECT_DOUBLE_EQ(*env_value("RESILIENT_TEST_Y", 1.5, parse_double), 2.5);
  setenv("RESILIENT_TEST_Y", "fast", 1);
  Status s = env_value("RESILIENT_TEST_Y", 1.5, parse_double).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().rfind("RESILIENT_TEST_Y='fast': ", 0), 0u) << s.message();
  unsetenv("RESILIENT_TEST_Y");
}

TEST(Clock, ManualClockMovesOnlyWhenTold) {
  ManualClock c;
  auto t0 = c.now();
  c.advance(std::chrono::milliseconds(250));
  EXPECT_DOUBLE_EQ(to_seconds(c.now() - t0), 0.25);
}

}  // namespace
}  // namespace resilient
