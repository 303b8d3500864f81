// File, directory and atomic-write primitives, including every injected failure path.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <set>

#include "io_test_util.hpp"
#include "resilient/io/file.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::io {
namespace {

using testing::TempDir;

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

std::string slurp(const std::string& p) {
  auto r = read_small_file(p, 1 << 20);
  return r.ok() ? *r : "<error: " + r.status().to_string() + ">";
}

bool has_temp_files(const std::string& dir) {
  auto names = list_dir(dir);
  for (const auto& n : *names) {
    if (n.find(".tmp.") != std::string::npos) return true;
  }
  return false;
}

TEST(FileHooks, SecondHookThrowsAndFdHooksSeeThePath) {
  TempDir dir;
  std::string seen;
  ScopedFileHook hook([&](FileOp op, const std::string& path) {
    if (op == FileOp::kFsync) seen = path;
    return 0;
  });
  EXPECT_THROW(ScopedFileHook([](FileOp, const std::string&) { return 0; }), std::logic_error);
  auto f = File::create(dir.file("a"), Feature::kOff);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  ASSERT_TRUE(f->sync().ok());
  EXPECT_EQ(seen, dir.file("a"));
  EXPECT_STREQ(file_op_name(FileOp::kRename), "rename");
}

TEST(FileHooks, NoHookMeansNoInterference) {
  EXPECT_EQ(file_hook(FileOp::kWrite, 0), 0);
  EXPECT_EQ(file_hook(FileOp::kOpen, std::string("/x")), 0);
}

TEST(File, CreateDirectOnDiskAndBasicOps) {
  TempDir dir;
  auto f = File::create(dir.file("d"), Feature::kAuto);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_TRUE(f->is_open());
  EXPECT_TRUE(f->direct()) << "the test disk (/tmp) should accept O_DIRECT";
  ASSERT_TRUE(f->truncate(12345).ok());
  EXPECT_EQ(*f->size(), 12345u);
  EXPECT_TRUE(f->sync().ok());
  EXPECT_TRUE(f->close().ok());
  EXPECT_FALSE(f->is_open());
  EXPECT_TRUE(f->close().ok());  // idempotent
  auto r = File::open_read(dir.file("d"), Feature::kOff);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->direct());
  File moved = std::move(r).value();
  EXPECT_TRUE(moved.is_open());
}

TEST(File, OpenMissingIsNotFound) {
  auto r = File::open_read("/nonexistent/dir/file", Feature::kAuto);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().path(), "/nonexistent/dir/file");
}

TEST(File, DirectRefusedFallsBackToBufferedOnAuto) {
  TempDir dir;
  int opens = 0;
  ScopedFileHook hook([&](FileOp op, const std::string&) {
    return op == FileOp::kOpen && opens++ == 0 ? EINVAL : 0;  // refuse the O_DIRECT attempt
  });
  auto f = File::create(dir.file("x"), Feature::kAuto);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_FALSE(f->direct());
  EXPECT_EQ(opens, 2);
}

TEST(File, DirectRefusedIsAnErrorWhenRequired) {
  TempDir dir;
  ScopedFileHook hook(
      [&](FileOp op, const std::string&) { return op == FileOp::kOpen ? EINVAL : 0; });
  auto f = File::create(dir.file("x"), Feature::kOn);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(f.status().sys_errno(), EINVAL);
}

TEST(File, TmpfsWorksWithAuto) {
  struct stat st {};
  if (::stat("/dev/shm", &st) != 0) GTEST_SKIP() << "no /dev/shm";
  TempDir dir("/dev/shm");
  auto f = File::create(dir.file("t"), Feature::kAuto);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  // Newer kernels accept O_DIRECT on tmpfs; older ones refuse it and we fall back. Either way
  // the file must be usable.
  ASSERT_TRUE(f->truncate(4096).ok());
  EXPECT_TRUE(f->sync().ok());
}

TEST(Dirs, MakeDirsNestedAndExisting) {
  TempDir dir;
  const std::string deep = dir.file("a/b/c");
  ASSERT_TRUE(make_dirs(deep).ok());
  EXPECT_TRUE(exists(deep));
  EXPECT_TRUE(make_dirs(deep).ok());
  EXPECT_TRUE(make_dirs(deep + "/").ok());
  std::ofstream(dir.file("plain")) << "x";
  Status s = make_dirs(dir.file("plain/sub"));
  EXPECT_FALSE(s.ok());
  Status over = make_dirs(dir.file("plain"));
  EXPECT_EQ(over.sys_errno(), ENOTDIR);
}

TEST(Dirs, MakeDirsMkdirFailure) {
  TempDir dir;
  ScopedFileHook hook(
      [](FileOp op, const std::string&) { return op == FileOp::kMkdir ? EACCES : 0; });
  Status s = make_dirs(dir.file("new"));
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EACCES);
}

TEST(Dirs, SyncDir) {
  TempDir dir;
  EXPECT_TRUE(sync_dir(dir.path()).ok());
  EXPECT_EQ(sync_dir(dir.file("missing")).code(), StatusCode::kNotFound);
  ScopedFileHook hook([](FileOp op, const std::string&) { return op == FileOp::kFsync ? EIO : 0; });
  Status s = sync_dir(dir.path());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EIO);
}

TEST(Dirs, ListDir) {
  TempDir dir;
  std::ofstream(dir.file("a")) << "1";
  ASSERT_TRUE(make_dirs(dir.file("b")).ok());
  auto names = list_dir(dir.path());
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(std::set<std::string>(names->begin(), names->end()), (std::set<std::string>{"a", "b"}));
  EXPECT_EQ(list_dir(dir.file("nope")).status().code(), StatusCode::kNotFound);
}

TEST(Dirs, RemoveTreeGoesThroughTheHooks) {
  TempDir dir;
  ASSERT_TRUE(make_dirs(dir.file("t/x/y")).ok());
  std::ofstream(dir.file("t/f1")) << "1";
  std::ofstream(dir.file("t/x/y/f2")) << "2";
  std::mutex mu;
  std::vector<std::pair<FileOp, std::string>> ops;
  {
    ScopedFileHook hook([&](FileOp op, const std::string& p) {
      std::lock_guard<std::mutex> lock(mu);
      ops.emplace_back(op, p);
      return 0;
    });
    ASSERT_TRUE(remove_tree(dir.file("t")).ok());
  }
  EXPECT_FALSE(exists(dir.file("t")));
  int unlinks = 0, rmdirs = 0;
  for (auto& [op, p] : ops) {
    unlinks += op == FileOp::kUnlink;
    rmdirs += op == FileOp::kRmdir;
  }
  EXPECT_EQ(unlinks, 2);
  EXPECT_EQ(rmdirs, 3);
  EXPECT_TRUE(remove_tree(dir.file("t")).ok());  // already gone
}

TEST(Dirs, RemoveTreeReportsUnlinkFailure) {
  TempDir dir;
  ASSERT_TRUE(make_dirs(dir.file("t")).ok());
  std::ofstream(dir.file("t/f")) << "1";
  ScopedFileHook hook(
      [](FileOp op, const std::string&) { return op == FileOp::kUnlink ? EPERM : 0; });
  Status s = remove_tree(dir.file("t"));
  EXPECT_EQ(s.sys_errno(), EPERM);
  EXPECT_EQ(s.path(), dir.file("t/f"));
  EXPECT_TRUE(exists(dir.file("t/f")));
}

TEST(Dirs, RenamePath) {
  TempDir dir;
  std::ofstream(dir.file("a")) << "1";
  ASSERT_TRUE(rename_path(dir.file("a"), dir.file("b")).ok());
  EXPECT_TRUE(exists(dir.file("b")));
  EXPECT_EQ(rename_path(dir.file("a"), dir.file("c")).code(), StatusCode::kNotFound);
}

TEST(AtomicWrite, WritesAndReplaces) {
  TempDir dir;
  const std::string p = dir.file("m.json");
  ASSERT_TRUE(write_file_atomic(p, "old").ok());
  EXPECT_EQ(slurp(p), "old");
  ASSERT_TRUE(write_file_atomic(p, std::string(100000, 'n')).ok());
  EXPECT_EQ(slurp(p), std::string(100000, 'n'));
  EXPECT_FALSE(has_temp_files(dir.path()));
}

class AtomicWriteFailure : public ::testing::TestWithParam<std::pair<FileOp, int>> {};

TEST_P(AtomicWriteFailure, LeavesOldContentAndNoTempFile) {
  TempDir dir;
  const std::string p = dir.file("latest");
  ASSERT_TRUE(write_file_atomic(p, "step-1").ok());
  const auto [fail_op, err] = GetParam();
  Status s;
  {
    ScopedFileHook hook([&, fail_op = fail_op, err = err](FileOp op, const std::string&) {
      return op == fail_op ? err : 0;
    });
    s = write_file_atomic(p, "step-2");
  }
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.sys_errno(), err);
  EXPECT_EQ(slurp(p), "step-1");
  EXPECT_FALSE(has_temp_files(dir.path()));
  if (err == ENOSPC) EXPECT_EQ(s.code(), StatusCode::kNoSpace);
}

INSTANTIATE_TEST_SUITE_P(Ops, AtomicWriteFailure,
                         ::testing::Values(std::make_pair(FileOp::kWrite, ENOSPC),
                                           std::make_pair(FileOp::kWrite, EIO),
                                           std::make_pair(FileOp::kFsync, EIO),
                                           std::make_pair(FileOp::kRename, EIO),
                                           std::make_pair(FileOp::kClose, EIO)));

TEST(AtomicWrite, ShortWritesAreCompleted) {
  TempDir dir;
  ScopedFileHook hook([](FileOp op, const std::string&) { return op == FileOp::kWrite ? -3 : 0; });
  ASSERT_TRUE(write_file_atomic(dir.file("s"), "0123456789").ok());
  EXPECT_EQ(slurp(dir.file("s")), "0123456789");
}

TEST(ReadSmallFile, LimitAndMissing) {
  TempDir dir;
  ASSERT_TRUE(write_file_atomic(dir.file("f"), std::string(5000, 'z')).ok());
  auto r = read_small_file(dir.file("f"), 4999);
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(r.status().path(), dir.file("f"));
  EXPECT_EQ(read_small_file(dir.file("g"), 10).status().code(), StatusCode::kNotFound);
  ScopedFileHook hook([](FileOp op, const std::string&) { return op == FileOp::kRead ? EIO : 0; });
  EXPECT_EQ(read_small_file(dir.file("f"), 10000).status().sys_errno(), EIO);
}

// Opening relative to a directory descriptor: no symbolic link is followed below the trusted
// directory, in any component, and the error says so.
TEST(Dirs, RelativeOpensNeverFollowLinks) {
  TempDir dir, outside;
  ASSERT_TRUE(make_dirs(dir.file("a/b")).ok());
  ASSERT_EQ(::symlink(outside.path().c_str(), dir.file("link").c_str()), 0);
  ASSERT_EQ(::symlink(dir.file("a").c_str(), dir.file("a/b/up").c_str()), 0);
  auto top = Dir::open(dir.path());
  ASSERT_TRUE(top.ok()) << top.status().to_string();
  auto ab = top->open_dir("a/b", true);
  ASSERT_TRUE(ab.ok()) << ab.status().to_string();
  EXPECT_EQ(ab->path(), dir.file("a/b"));
  ASSERT_TRUE(write_file_atomic_at(*ab, "f", "hello").ok());
  EXPECT_EQ(slurp(dir.file("a/b/f")), "hello");
  EXPECT_EQ(*read_small_file_at(*ab, "f", 100), "hello");
  EXPECT_FALSE(has_temp_files(dir.file("a/b")));

  Status w = top->open_dir("link", true).status();  // a write is an I/O error naming the link
  EXPECT_EQ(w.sys_errno(), ELOOP) << w.to_string();
  EXPECT_NE(w.to_string().find("symbolic link"), std::string::npos) << w.to_string();
  EXPECT_EQ(w.path(), dir.file("link"));
  Status r = top->open_dir("a/b/up/b", false).status();  // a read: corrupt, in any component
  EXPECT_EQ(r.code(), StatusCode::kCorrupt) << r.to_string();
  EXPECT_EQ(r.path(), dir.file("a/b/up"));
  EXPECT_EQ(top->make_dir("link").sys_errno(), ELOOP);
  EXPECT_TRUE(top->make_dir("a").ok());
  EXPECT_EQ(top->open_dir("a/../link", true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(File::create_at(*ab, "../f", Feature::kOff).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_EQ(::symlink(outside.file("planted").c_str(), dir.file("a/b/planted").c_str()), 0);
  EXPECT_EQ(File::create_at(*ab, "planted", Feature::kOff).status().sys_errno(), ELOOP);
  EXPECT_EQ(File::open_read_at(*ab, "planted", Feature::kOff).status().code(),
            StatusCode::kCorrupt);
  EXPECT_EQ(list_dir(outside.path())->size(), 0u) << "nothing was written outside";
}

}  // namespace
}  // namespace resilient::io
