// Crash-consistency protocol for a checkpoint root.
//
// Layout:   root/step-<12 digits>/{manifest.json, rank-<5 digits>.data ...}   committed steps
//           root/.tmp-step-<12 digits>/                                       a save in progress
//           root/latest                                                       "step-...\n" hint
//
// A save writes every rank's data file into root/.tmp-step-N/ and fsyncs each one. Only then is
// manifest.json written into the same directory and fsynced, then the directory itself is
// fsynced, then it is renamed to root/step-N (rename is atomic within a file system), and root is
// fsynced so the rename is durable. Finally `latest` is replaced atomically (write a temporary
// file, rename over `latest`), without fsyncs: it is a hint, which a crash may leave stale.
// The ranks' own manifests (rank-<r>.json, merged by commit_shards) are fsynced as files; the
// directory fsync after the merged manifest makes their names durable too.
//
// What a crash leaves behind, at each point:
//  - before the rename: a .tmp- directory, which readers never look at; the previous committed
//    step is untouched. The next save of that step, or retention, removes the leftover.
//  - after the rename but before `latest` is updated: a complete step-N whose manifest and data
//    are durable; `latest` still names the previous step. Readers do not trust `latest` alone:
//    discovery lists step-* directories that contain manifest.json and takes the newest, and
//    load() verifies checksums, falling back to older steps.
// A step directory therefore either holds a manifest written after all its data was durable, or
// it is not a committed step. Saving a step that already exists exchanges the two directories
// with renameat2(RENAME_EXCHANGE), so at every instant one complete step-N exists; where the
// file system lacks RENAME_EXCHANGE, the old directory is moved aside first (a crash in that
// short window loses that one step, never an older one).
// Retention deletes only steps older than the newest `keep` committed ones, after the new commit
// is durable, and deletes a directory by first renaming it to .trash-..., so a half-deleted step
// never looks committed.

#include "resilient/checkpoint/commit.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <set>

#include "resilient/common/logging.hpp"
#include "resilient/io/file.hpp"
#include "resilient/io/file_hooks.hpp"

namespace resilient::checkpoint {
namespace {

constexpr const char* kLatestName = "latest";

bool is_dir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& p) {
  struct stat st;
  return ::lstat(p.c_str(), &st) == 0;
}

// rename(from, to) exchanging an existing `to`. Returns 0 or an errno.
int exchange(const std::string& from, const std::string& to) {
  if (int e = io::file_hook(io::FileOp::kRename, to)) return e;
  long r = ::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE);
  return r == 0 ? 0 : errno;
}

}  // namespace

std::string tmp_dir_name(int64_t step) { return ".tmp-" + step_dir_name(step); }

std::string tmp_dir_path(const std::string& root, int64_t step) {
  return root + "/" + tmp_dir_name(step);
}

std::string step_dir_path(const std::string& root, int64_t step) {
  return root + "/" + step_dir_name(step);
}

Result<io::Dir> prepare_tmp_dir(const std::string& root, int64_t step, bool fresh) {
  RESILIENT_RETURN_IF_ERROR(io::make_dirs(root));
  // A stale leftover is removed without following links (a link itself is unlinked).
  if (fresh) RESILIENT_RETURN_IF_ERROR(io::remove_tree(tmp_dir_path(root, step)));
  RESILIENT_ASSIGN_OR_RETURN(io::Dir top, io::Dir::open(root));
  RESILIENT_RETURN_IF_ERROR(top.make_dir(tmp_dir_name(step)));
  return top.open_dir(tmp_dir_name(step), /*for_write=*/true);
}

Status commit_step(const std::string& root, const Manifest& manifest) {
  const std::string tmp = tmp_dir_path(root, manifest.step);
  const std::string final_dir = step_dir_path(root, manifest.step);
  {
    RESILIENT_ASSIGN_OR_RETURN(io::Dir top, io::Dir::open(root));
    RESILIENT_ASSIGN_OR_RETURN(io::Dir dir, top.open_dir(tmp_dir_name(manifest.step), true));
    RESILIENT_RETURN_IF_ERROR(io::write_file_atomic_at(dir, kManifestName, to_json(manifest)));
  }
  if (exists(final_dir)) {
    int err = exchange(tmp, final_dir);
    if (err == 0) {
      RESILIENT_RETURN_IF_ERROR(io::sync_dir(root));
      // tmp now holds the replaced step; it is no longer committed under any step-* name.
      RESILIENT_RETURN_IF_ERROR(io::remove_tree(tmp));
    } else if (err == EINVAL || err == ENOSYS) {
      log_once(
          "rename-exchange", LogLevel::kWarn,
          "file system lacks RENAME_EXCHANGE; replacing an existing step moves it aside first");
      const std::string trash = root + "/.trash-" + step_dir_name(manifest.step);
      RESILIENT_RETURN_IF_ERROR(io::remove_tree(trash));
      RESILIENT_RETURN_IF_ERROR(io::rename_path(final_dir, trash));
      RESILIENT_RETURN_IF_ERROR(io::rename_path(tmp, final_dir));
      RESILIENT_RETURN_IF_ERROR(io::sync_dir(root));
      RESILIENT_RETURN_IF_ERROR(io::remove_tree(trash));
    } else {
      return Status::from_errno(err, "renameat2(RENAME_EXCHANGE)", final_dir);
    }
  } else {
    RESILIENT_RETURN_IF_ERROR(io::rename_path(tmp, final_dir));
    RESILIENT_RETURN_IF_ERROR(io::sync_dir(root));
  }
  // `latest` is a hint for tools and humans; never let a newer `latest` point backwards.
  auto current = read_latest(root);
  if (!current || *current <= manifest.step) {
    RESILIENT_RETURN_IF_ERROR(io::write_file_atomic(
        root + "/" + kLatestName, step_dir_name(manifest.step) + "\n", io::Sync::kNone));
  }
  return ok_status();
}

Status commit_shards(const std::string& root, int64_t step, int world_size,
                     const std::string& save_id) {
  if (world_size < 1) return Status(StatusCode::kInvalidArgument, "world_size must be >= 1");
  RESILIENT_ASSIGN_OR_RETURN(io::Dir top, io::Dir::open(root));
  RESILIENT_ASSIGN_OR_RETURN(io::Dir dir, top.open_dir(tmp_dir_name(step), /*for_write=*/true));
  Manifest merged;
  merged.step = step;
  merged.world_size = world_size;
  merged.values = {
      {"format", "resilient.sharded/1"}, {"save_id", save_id}, {"ranks", nlohmann::json::array()}};
  std::set<std::string> names;
  std::vector<uint64_t> sizes;
  for (int r = 0; r < world_size; ++r) {
    const std::string name = "rank-" + std::to_string(r) + ".json";
    const std::string path = dir.child(name);
    auto text = io::read_small_file_at(dir, name, kMaxManifestBytes);
    if (!text.ok()) {
      return Status(text.status())
          .prepend("rank " + std::to_string(r) + " left no shard manifest for step " +
                   std::to_string(step));
    }
    RESILIENT_ASSIGN_OR_RETURN(Manifest m, parse_manifest(*text, path));
    const nlohmann::json* id =
        m.values.is_object() && m.values.contains("save_id") ? &m.values["save_id"] : nullptr;
    const bool own_shards =
        !m.shards.empty() && std::all_of(m.shards.begin(), m.shards.end(),
                                         [r](const ShardEntry& e) { return e.rank == r; });
    if (m.step != step || !own_shards || id == nullptr || *id != save_id) {
      return Status(StatusCode::kFailedPrecondition, "shard manifest of rank " + std::to_string(r) +
                                                         " belongs to another save of step " +
                                                         std::to_string(step))
          .with_path(path);
    }
    const auto base = static_cast<uint32_t>(merged.shards.size());
    for (const ShardEntry& e : m.shards) {  // the rank's data files (files_per_rank of them)
      struct stat st;
      const std::string data = dir.child(e.file);
      if (::fstatat(dir.fd(), e.file.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        return Status::from_errno(errno, "stat", data);
      }
      if (!S_ISREG(st.st_mode)) {
        return Status(StatusCode::kCorrupt, "not a regular file").with_path(data);
      }
      if (static_cast<uint64_t>(st.st_size) != e.bytes) {
        return Status(StatusCode::kCorrupt, "shard file size differs from its manifest")
            .with_path(data);
      }
      merged.shards.push_back(e);
      sizes.push_back(static_cast<uint64_t>(st.st_size));
    }
    for (auto& t : m.tensors) {
      if (!names.insert(t.name).second) {
        return Status(StatusCode::kInvalidArgument, "tensor '" + t.name +
                                                        "' is saved by more than one rank (rank " +
                                                        std::to_string(r) + ")");
      }
      t.shard += base;  // parse_manifest checked it indexes the rank's own shards
      merged.tensors.push_back(std::move(t));
    }
    if (r == 0) merged.meta = m.meta;
    merged.values["ranks"].push_back(std::move(m.values));
  }
  RESILIENT_RETURN_IF_ERROR(check_extents(merged, sizes));
  merged.meta["world_size"] = world_size;
  return commit_step(root, merged);
}

Result<std::vector<int64_t>> committed_steps(const std::string& root) {
  std::vector<int64_t> steps;
  auto names = io::list_dir(root);
  if (!names.ok()) {
    if (names.status().code() == StatusCode::kNotFound) return steps;
    return names.status();
  }
  for (const auto& name : *names) {
    int64_t step = parse_step_dir_name(name);
    if (step < 0) continue;
    // A step directory replaced by a symbolic link is not a step (never followed).
    struct stat st;
    if (::lstat((root + "/" + name).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (exists(root + "/" + name + "/" + kManifestName)) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<int64_t> read_latest(const std::string& root) {
  auto text = io::read_small_file(root + "/" + kLatestName, 256);
  if (!text.ok()) return std::nullopt;
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  int64_t step = parse_step_dir_name(name);
  if (step < 0) return std::nullopt;
  return step;
}

Result<std::vector<int64_t>> apply_retention(const std::string& root, int keep) {
  std::vector<int64_t> deleted;
  RESILIENT_ASSIGN_OR_RETURN(auto steps, committed_steps(root));
  if (keep > 0 && steps.size() > static_cast<size_t>(keep)) {
    size_t n = steps.size() - static_cast<size_t>(keep);
    for (size_t i = 0; i < n; ++i) {
      const std::string dir = step_dir_path(root, steps[i]);
      const std::string trash = root + "/.trash-" + step_dir_name(steps[i]);
      RESILIENT_RETURN_IF_ERROR(io::remove_tree(trash));
      RESILIENT_RETURN_IF_ERROR(io::rename_path(dir, trash));
      RESILIENT_RETURN_IF_ERROR(io::remove_tree(trash));
      deleted.push_back(steps[i]);
    }
  }
  // Leftover temporary directories of steps older than the newest commit are dead saves.
  if (!steps.empty()) {
    auto names = io::list_dir(root);
    if (names.ok()) {
      for (const auto& name : *names) {
        if (name.rfind(".tmp-", 0) != 0) continue;
        int64_t step = parse_step_dir_name(name.substr(5));
        if (step >= 0 && step < steps.back() && is_dir(root + "/" + name)) {
          RESILIENT_RETURN_IF_ERROR(io::remove_tree(root + "/" + name));
        }
      }
    }
  }
  return deleted;
}

Result<Manifest> read_manifest(const std::string& root, int64_t step) {
  const std::string path = step_dir_path(root, step) + "/" + kManifestName;
  // The step directory is opened without following a link (a step replaced by one is corrupt).
  Result<std::string> text = [&]() -> Result<std::string> {
    RESILIENT_ASSIGN_OR_RETURN(io::Dir top, io::Dir::open(root));
    RESILIENT_ASSIGN_OR_RETURN(io::Dir dir, top.open_dir(step_dir_name(step), /*for_write=*/false));
    return io::read_small_file_at(dir, kManifestName, kMaxManifestBytes);
  }();
  if (!text.ok())
    return Status(text.status()).prepend("reading manifest of step " + std::to_string(step));
  auto m = parse_manifest(*text, path);
  if (!m.ok()) return m.status();
  if (m->step != step) {
    Status s(StatusCode::kCorrupt, "manifest says step " + std::to_string(m->step) +
                                       " but lives in " + step_dir_name(step));
    s.with_path(path);
    return s;
  }
  return m;
}

}  // namespace resilient::checkpoint
