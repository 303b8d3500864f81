#pragma once
// The checkpoint engine: save() snapshots tensors into reusable host slabs and returns; a
// background writer persists the shard, commits the step and applies retention. load-side
// helpers find committed steps and restore tensors from them.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "resilient/checkpoint/format.hpp"
#include "resilient/checkpoint/restore.hpp"
#include "resilient/checkpoint/snapshot.hpp"
#include "resilient/common/thread_pool.hpp"
#include "resilient/io/engine.hpp"
#include "resilient/memory/pool.hpp"

namespace resilient::checkpoint {

/// Engine settings; from_env() applies RESILIENT_* overrides (docs/SETTINGS.md).
struct CheckpointOptions {
  std::string root;
  int keep = 3;  // committed steps kept; <= 0 keeps all
  int rank = 0;
  int world_size = 1;
  uint64_t chunk_bytes = 16ull << 20;  // RESILIENT_CHUNK_BYTES: checksum/compression unit
  int zstd_level = 0;                  // RESILIENT_ZSTD_LEVEL: 0 = no compression
  int copy_threads = 4;         // RESILIENT_COPY_THREADS: snapshot memcpy and hashing workers
  int restore_threads = 0;      // RESILIENT_RESTORE_THREADS; 0: auto_restore_threads()
  int files_per_rank = 1;       // RESILIENT_FILES_PER_RANK: data files a save writes at once
  int background_nice = 10;     // RESILIENT_BACKGROUND_NICE: priority drop of writer threads
  std::string background_cpus;  // RESILIENT_BACKGROUND_CPUS: e.g. "8-15"; empty = unpinned
  Duration timeout = std::chrono::seconds(600);  // RESILIENT_CKPT_TIMEOUT_S: per blocking step
  io::IoOptions io;
  memory::PoolOptions pool;
  uint64_t copy_group_bytes = kCopyGroupBytes;  // not a setting (tests make groups small)
  /// The CUDA runtime for device tensors; null: memory::CudaRuntime::get() (tests inject a fake).
  const memory::CudaRuntime* cuda = nullptr;

  static Result<CheckpointOptions> from_env(std::string root);
  Status validate() const;
};

/// The automatic restore_threads: `usable_cpus` shared by `local_ranks` processes of the host,
/// at least 4 and at most 16 (on a 16-core host one rank reads tmpfs at 10.7 GB/s with 16
/// threads against 4.7 with 4: benchmarks/RESULTS.md, "pipeline ceiling").
int auto_restore_threads(int usable_cpus, int local_ranks);

/// When save() returns for device tensors. Host tensors are always copied before it returns.
enum class SaveMode {
  kBlocking,  // after the device-to-host copies completed: the tensors may change at once
  kOverlap,   // at once; the tensors must not change until SaveHandle::wait_snapshot() returns
};

/// What a save measured, in seconds since save() was called.
struct SaveStats {
  double issue_s = 0;     // until every copy was issued (host copies done, device copies queued)
  double snapshot_s = 0;  // until save() returned (blocking mode: device copies complete too)
  double written_s = 0;   // data file durable
  double durable_s = 0;   // committed (manifest, rename, fsyncs)
  uint64_t bytes = 0;     // tensor bytes
  uint64_t stored_bytes = 0;
};

/// One save in flight. Thread-safe.
class SaveHandle {
 public:
  SaveHandle(int64_t step, std::shared_ptr<DeviceCopies> copies)
      : step_(step), copies_(std::move(copies)) {}
  int64_t step() const { return step_; }
  /// Waits until the snapshot no longer reads the caller's tensors (device copies complete).
  Status wait_snapshot(Duration timeout) const;
  /// Orders `stream` after the device copies without blocking the caller (see
  /// DeviceCopies::fence); the caller must keep the tensors alive until the copies complete.
  Status fence_stream(memory::StreamHandle stream) const {
    return copies_ ? copies_->fence(stream) : ok_status();
  }
  bool done() const;
  /// Waits until the save is durable and committed; returns its error, or kTimeout.
  Status wait(Duration timeout) const;
  SaveStats stats() const;

  // Writer side.
  void finish(Status status, SaveStats stats);

 private:
  const int64_t step_;
  const std::shared_ptr<DeviceCopies> copies_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  Status status_;
  SaveStats stats_;
};

/// How a read shares its host: `local_ranks` > 0 is how many ranks share this host's CPUs,
/// where the caller knows it (else torchrun's LOCAL_WORLD_SIZE, or 1), for the automatic
/// reader threads (restore_threads 0); `threads` > 0 sets them (the ranks of a host sharing a
/// queue agree on one count: their plans must match). `queue` and `bytes_read`: as in
/// RestoreOptions.
struct ReadSharing {
  int local_ranks = 0;
  int threads = 0;
  int64_t* queue = nullptr;
  uint64_t* bytes_read = nullptr;
};

/// Thread-safe: save() may be called from one thread at a time; reads from any.
class Checkpointer {
 public:
  /// `pool`: host slabs shared with other checkpointers (null: a pool of its own, from
  /// options.pool); a staging made by one of them may then be saved by another (save_staged).
  static Result<std::unique_ptr<Checkpointer>> create(
      CheckpointOptions options, std::shared_ptr<memory::HostPool> pool = nullptr);
  /// Waits (bounded by the timeout) for pending saves, then stops the writer.
  ~Checkpointer();

  /// Snapshots `tensors` (blocking until they may change again) and queues the write. With
  /// `commit` false (multi-rank), the shard and its shard manifest (rank-N.json) are left in the
  /// step's temporary directory for a coordinator to commit with commit_step().
  Result<std::shared_ptr<SaveHandle>> save(int64_t step, std::span<const TensorSpec> tensors,
                                           nlohmann::json values, bool commit = true,
                                           SaveMode mode = SaveMode::kBlocking);
  /// save() with the values as JSON text, parsed on the writer thread rather than the caller's
  /// (a large state's document takes milliseconds to parse); text that is not JSON fails the
  /// save (the handle's error, kInvalidArgument).
  Result<std::shared_ptr<SaveHandle>> save_json(int64_t step, std::span<const TensorSpec> tensors,
                                                std::string values_json, bool commit = true,
                                                SaveMode mode = SaveMode::kBlocking);
  /// The snapshot half of save(): copies `tensors` into slabs of the pool and returns once every
  /// copy (device copies included) completed, so the caller may change its tensors.
  Result<Staging> stage(std::span<const TensorSpec> tensors);
  /// The write half: queues `staging` (from stage() of a checkpointer sharing this pool, then
  /// perhaps restage()d) as step `step`'s shard, without copying it. kInvalidArgument for a
  /// staging whose slabs belong to another pool.
  Result<std::shared_ptr<SaveHandle>> save_staged(int64_t step, Staging staging,
                                                  nlohmann::json values, bool commit = true);
  /// Waits for every queued save and for the writer to finish its background work (retention).
  Status wait_all(Duration timeout);
  /// wait_all, then frees the host pool's slabs not on loan, unless another checkpointer or a
  /// staging shares the pool: a closed checkpointer that is still referenced (a variable after
  /// its `with` block, an error's traceback) holds no pool memory, which is the size of a
  /// snapshot. A later save or read allocates again.
  Status close(Duration timeout);

  Result<std::vector<int64_t>> steps() const;
  Result<Manifest> manifest(int64_t step) const;
  /// Reads `targets` (restore_tensors).
  Status read(const Manifest& manifest, std::span<const ReadTarget> targets,
              const ReadSharing& sharing = {});
  /// The reader threads a read would run with `local_ranks` (as in ReadSharing).
  int reader_threads(int local_ranks = 0) const;
  Status verify(const Manifest& manifest);

  const CheckpointOptions& options() const { return options_; }
  memory::HostPool& pool() { return *pool_; }
  const std::shared_ptr<memory::HostPool>& shared_pool() const { return pool_; }
  /// The io engine chosen for writes ("io_uring" or "threads").
  const char* io_backend() const { return engine_->name(); }

 private:
  struct Job {
    int64_t step;
    Staging staging;
    nlohmann::json values;
    std::string values_json;  // when not empty: parsed into `values` by the writer
    bool commit;
    std::shared_ptr<SaveHandle> handle;
    TimePoint started;
    double issue_s;
    double snapshot_s;
  };
  explicit Checkpointer(CheckpointOptions options);
  Result<std::shared_ptr<SaveHandle>> enqueue(int64_t step, std::span<const TensorSpec> tensors,
                                              nlohmann::json values, std::string values_json,
                                              bool commit, SaveMode mode);
  void writer_loop();
  Status write_job(Job& job, SaveStats& stats);

  CheckpointOptions options_;
  std::shared_ptr<memory::HostPool> pool_;
  std::unique_ptr<ThreadPool> workers_;  // snapshot copies (the caller waits on them)
  std::unique_ptr<ThreadPool> hashers_;  // checksums and compression in the background
  std::unique_ptr<DeviceStreams> streams_;
  std::unique_ptr<io::IoEngine> engine_;  // used by the writer thread only
  // One more engine per further data file (files_per_rank > 1), used by the writer's threads.
  std::vector<std::unique_ptr<io::IoEngine>> file_engines_;
  uint64_t registered_epoch_ = ~0ull;  // pool epoch of the engine's fixed-buffer registration
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::vector<std::shared_ptr<SaveHandle>> pending_;
  bool stop_ = false;
  bool busy_ = false;  // the writer is handling a job (including its retention pass)
  std::thread writer_;
};

}  // namespace resilient::checkpoint
