// NCCL loading and version gating: injected tables, dlopen failure, and the real library when
// the machine has one (skipped otherwise).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "resilient/comm/nccl_api.hpp"
#include "test_comm_fake_nccl.hpp"

namespace resilient::comm {
namespace {

using testing::FakeNccl;

class NcclApiTest : public ::testing::Test {
 protected:
  void SetUp() override { FakeNccl::current() = &fake_; }
  void TearDown() override { FakeNccl::current() = nullptr; }
  FakeNccl fake_;
};

TEST(NcclVersion, CodesAndFormatting) {
  EXPECT_EQ(nccl_version_code(2, 28, 9), 22809);
  EXPECT_EQ(nccl_version_code(2, 7, 8), 2708);
  EXPECT_EQ(format_nccl_version(22809), "2.28.9");
  EXPECT_EQ(format_nccl_version(2708), "2.7.8");
  EXPECT_EQ(kNcclHeaderVersion, 22809);
}

TEST(NcclConfig, NonBlockingAndNeverNewerThanTheLibrary) {
  NcclConfig c = make_nccl_config(nccl_version_code(2, 21, 5), false);
  EXPECT_EQ(c.blocking, 0);
  EXPECT_EQ(c.magic, 0xcafebeefu);
  EXPECT_EQ(c.version, 22105u);
  EXPECT_EQ(c.size, sizeof(NcclConfig));
  EXPECT_EQ(c.min_ctas, kNcclConfigUndefInt);
  EXPECT_EQ(c.comm_name, nullptr);
  EXPECT_EQ(make_nccl_config(nccl_version_code(2, 30, 1), true).version, 22809u);
  EXPECT_EQ(make_nccl_config(nccl_version_code(2, 30, 1), true).blocking, 1);
}

TEST_F(NcclApiTest, FeaturesFollowTheRuntimeVersion) {
  struct Case {
    int version;
    bool shrink;
    bool revoke;
  };
  for (Case c : {Case{nccl_version_code(2, 21, 5), false, false},
                 Case{nccl_version_code(2, 27, 0), true, false},
                 Case{nccl_version_code(2, 28, 6), true, false},
                 Case{nccl_version_code(2, 28, 7), true, true}}) {
    fake_.version = c.version;
    auto lib = NcclLibrary::from_table(fake_.table());
    ASSERT_TRUE(lib.ok());
    EXPECT_EQ((*lib)->version(), c.version);
    EXPECT_TRUE((*lib)->supports(NcclFeature::kNonBlocking));
    EXPECT_EQ((*lib)->supports(NcclFeature::kShrink), c.shrink) << c.version;
    EXPECT_EQ((*lib)->supports(NcclFeature::kRevoke), c.revoke) << c.version;
  }
}

TEST_F(NcclApiTest, RequireNamesTheVersionNeeded) {
  fake_.version = nccl_version_code(2, 27, 3);
  auto lib = NcclLibrary::from_table(fake_.table(), "fake.so");
  ASSERT_TRUE(lib.ok());
  Status st = (*lib)->require(NcclFeature::kRevoke);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("2.28.7"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("2.27.3"), std::string::npos) << st.message();
  EXPECT_TRUE((*lib)->require(NcclFeature::kShrink).ok());
}

TEST_F(NcclApiTest, MissingOptionalSymbolDisablesTheFeature) {
  fake_.has_shrink = false;
  auto lib = NcclLibrary::from_table(fake_.table());
  ASSERT_TRUE(lib.ok());
  EXPECT_FALSE((*lib)->supports(NcclFeature::kShrink));
  EXPECT_NE((*lib)->require(NcclFeature::kShrink).message().find("symbol is missing"),
            std::string::npos);
}

TEST_F(NcclApiTest, RejectsTooOldOrIncompleteTables) {
  fake_.version = nccl_version_code(2, 13, 4);
  auto old = NcclLibrary::from_table(fake_.table());
  EXPECT_EQ(old.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(old.status().message().find("2.13.4"), std::string::npos);
  fake_.version = nccl_version_code(2, 28, 9);
  NcclApi api = fake_.table();
  api.comm_abort = nullptr;
  auto incomplete = NcclLibrary::from_table(api);
  EXPECT_EQ(incomplete.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(incomplete.status().message().find("ncclCommAbort"), std::string::npos);
}

TEST(NcclLoad, MissingLibraryIsAClearUnavailableError) {
  NcclLoadOptions o;
  o.path = "/nonexistent/nccl/lib";
  o.search_system = false;
  auto lib = NcclLibrary::load(o);
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(lib.status().message().find("/nonexistent/nccl/lib"), std::string::npos);
  EXPECT_NE(lib.status().message().find("RESILIENT_NCCL_PATH"), std::string::npos);
}

TEST(NcclLoad, DisabledBySetting) {
  NcclLoadOptions o;
  o.enabled = Feature::kOff;
  EXPECT_EQ(NcclLibrary::load(o).status().code(), StatusCode::kUnavailable);
}

TEST(NcclLoad, NotALibraryIsRejected) {
  NcclLoadOptions o;
  o.path = "/etc/hostname";
  o.search_system = false;
  EXPECT_EQ(NcclLibrary::load(o).status().code(), StatusCode::kUnavailable);
}

TEST(NcclLoad, RealLibraryStaysMappedAfterTheLastReference) {
  auto lib = NcclLibrary::load(NcclLoadOptions::from_env().value());
  if (!lib.ok()) GTEST_SKIP() << "no NCCL on this machine: " << lib.status().message();
  const std::string origin = (*lib)->origin();
  lib = Status(StatusCode::kCancelled, "dropped");  // the only reference goes away
  void* still = ::dlopen(origin.c_str(), RTLD_NOW | RTLD_NOLOAD);
  EXPECT_NE(still, nullptr) << origin << " was unmapped; NCCL threads would crash";
  if (still != nullptr) ::dlclose(still);
}

TEST(NcclLoad, RealLibraryWhenPresent) {
  NcclLoadOptions o = NcclLoadOptions::from_env().value();
  auto lib = NcclLibrary::load(o);
  if (!lib.ok()) GTEST_SKIP() << "no NCCL on this machine: " << lib.status().message();
  EXPECT_GE((*lib)->version(), nccl_version_code(2, 14, 0));
  EXPECT_FALSE((*lib)->origin().empty());
  if ((*lib)->version() >= nccl_version_code(2, 28, 7)) {
    EXPECT_TRUE((*lib)->supports(NcclFeature::kRevoke));
    EXPECT_TRUE((*lib)->supports(NcclFeature::kShrink));
  }
}

}  // namespace
}  // namespace resilient::comm
