#pragma once
// The crash-consistent commit protocol over a checkpoint root directory (see commit.cpp for the
// protocol in prose), plus discovery and retention of committed steps.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "resilient/checkpoint/format.hpp"
#include "resilient/common/status.hpp"
#include "resilient/io/file.hpp"

namespace resilient::checkpoint {

/// root/.tmp-step-000000000042: where a step's files are written before it is committed.
std::string tmp_dir_path(const std::string& root, int64_t step);
/// ".tmp-step-000000000042"
std::string tmp_dir_name(int64_t step);
/// root/step-000000000042
std::string step_dir_path(const std::string& root, int64_t step);

/// Removes a stale temporary directory of `step` (from a crashed save) and creates it empty.
/// With `fresh` false, keeps an existing one (the ranks of one save share it). Either way
/// returns it opened: files under a checkpoint root are opened relative to directory
/// descriptors, never through a symbolic link, so a `.tmp-step-N` that is a link (to /etc, say)
/// is an error (ELOOP, "refusing to write through a symbolic link") and nothing is written
/// outside the root.
Result<io::Dir> prepare_tmp_dir(const std::string& root, int64_t step, bool fresh = true);

/// Commits `manifest` (whose shard files are already durable in the temporary directory):
/// writes and fsyncs manifest.json, fsyncs the directory, renames it to step-N (atomically
/// exchanging an existing step-N), fsyncs the root, then points `latest` at it. Returns after
/// the commit is durable.
Status commit_step(const std::string& root, const Manifest& manifest);

/// The coordinator's half of a multi-rank save. Every rank r in [0, world_size) has saved with
/// commit=false, leaving rank-<r>.data and its shard manifest rank-<r>.json (durable) in the step's
/// temporary directory. This reads and validates the `world_size` shard manifests, checks that
/// each carries values["save_id"] == `save_id` (a leftover of an older save is
/// kFailedPrecondition), checks every data file's size against its chunk extents (kCorrupt), merges
/// them into one Manifest (shard indices remapped, tensor names unique across ranks, values =
/// {"format": "resilient.sharded/1", "save_id", "ranks": [values of rank 0, 1, ...]}), and
/// commits it with commit_step(). A missing rank manifest is kNotFound naming the rank.
/// Thread safety: call from one coordinator per (root, step).
Status commit_shards(const std::string& root, int64_t step, int world_size,
                     const std::string& save_id);

/// Steps with a committed directory (a directory, not a symbolic link, that holds
/// manifest.json), ascending. Missing root -> {}.
Result<std::vector<int64_t>> committed_steps(const std::string& root);
/// The step named by the `latest` pointer, if the file exists and parses.
std::optional<int64_t> read_latest(const std::string& root);

/// Deletes the oldest committed steps beyond the newest `keep` (keep <= 0 keeps all), and
/// temporary directories of steps older than the newest committed one. Returns the deleted steps.
Result<std::vector<int64_t>> apply_retention(const std::string& root, int keep);

/// Reads and validates step-N/manifest.json (kNotFound, kCorrupt, kVersionMismatch). A step
/// directory or manifest that is a symbolic link is kCorrupt ("is a symbolic link (refused)").
Result<Manifest> read_manifest(const std::string& root, int64_t step);

}  // namespace resilient::checkpoint
