#include "resilient/checkpoint/checkpointer.hpp"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "resilient/checkpoint/commit.hpp"
#include "resilient/checkpoint/persist.hpp"
#include "resilient/common/logging.hpp"
#include "resilient/io/file.hpp"

namespace resilient::checkpoint {

int auto_restore_threads(int usable_cpus, int local_ranks) {
  return std::clamp(usable_cpus / std::max(local_ranks, 1), 4, 16);
}

namespace {

// The reader threads of a restore: `configured`, or with 0 this process's share of the CPUs it
// may run on, shared by `local_ranks` ranks of the host (0: torchrun's LOCAL_WORLD_SIZE, else 1).
int restore_threads(int configured, int local_ranks = 0) {
  if (configured > 0) return configured;
  cpu_set_t set;
  int cpus = ::sched_getaffinity(0, sizeof set, &set) == 0
                 ? CPU_COUNT(&set)
                 : static_cast<int>(std::thread::hardware_concurrency());
  int64_t local = local_ranks > 0 ? local_ranks : 1;
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE"); v != nullptr && local_ranks <= 0) {
    auto parsed = parse_int(v);
    if (parsed.ok() && *parsed > 0 && *parsed < (1 << 20)) local = *parsed;
  }
  return auto_restore_threads(cpus, static_cast<int>(local));
}

}  // namespace

Result<CheckpointOptions> CheckpointOptions::from_env(std::string root) {
  CheckpointOptions o;
  o.root = std::move(root);
  RESILIENT_ASSIGN_OR_RETURN(o.chunk_bytes,
                             env_value("RESILIENT_CHUNK_BYTES", o.chunk_bytes, parse_bytes));
  auto small = [](const char* name, int* field) -> Status {
    RESILIENT_ASSIGN_OR_RETURN(int64_t v, env_value<int64_t>(name, *field, parse_int));
    if (v < -(1 << 20) || v > (1 << 20)) {  // the real range is checked by validate()
      return Status(StatusCode::kInvalidArgument,
                    std::string(name) + "=" + std::to_string(v) + " is out of range");
    }
    *field = static_cast<int>(v);
    return ok_status();
  };
  RESILIENT_RETURN_IF_ERROR(small("RESILIENT_ZSTD_LEVEL", &o.zstd_level));
  RESILIENT_RETURN_IF_ERROR(small("RESILIENT_COPY_THREADS", &o.copy_threads));
  RESILIENT_RETURN_IF_ERROR(small("RESILIENT_RESTORE_THREADS", &o.restore_threads));
  RESILIENT_RETURN_IF_ERROR(small("RESILIENT_FILES_PER_RANK", &o.files_per_rank));
  RESILIENT_RETURN_IF_ERROR(small("RESILIENT_BACKGROUND_NICE", &o.background_nice));
  if (auto cpus = env_string("RESILIENT_BACKGROUND_CPUS")) o.background_cpus = *cpus;
  RESILIENT_ASSIGN_OR_RETURN(
      double timeout_s, env_value("RESILIENT_CKPT_TIMEOUT_S", to_seconds(o.timeout), parse_double));
  o.timeout = from_seconds(timeout_s);
  RESILIENT_ASSIGN_OR_RETURN(o.io, io::IoOptions::from_env());
  RESILIENT_ASSIGN_OR_RETURN(o.pool, memory::PoolOptions::from_env());
  return o;
}

Status CheckpointOptions::validate() const {
  auto bad = [](const std::string& m) { return Status(StatusCode::kInvalidArgument, m); };
  // "<field> (<its RESILIENT_* variable>) must be in [lo, hi], got v": the variable is named
  // because most values come from the environment (docs/SETTINGS.md has the same ranges).
  auto outside = [&](const char* field, const char* variable, int64_t v, int64_t lo, int64_t hi) {
    return bad(std::string(field) + " (" + variable + ") must be in [" + std::to_string(lo) + ", " +
               std::to_string(hi) + "], got " + std::to_string(v));
  };
  if (root.empty()) return bad("checkpoint root must not be empty");
  if (rank < 0 || world_size < 1 || rank >= world_size)
    return bad("rank must be in [0, world_size)");
  if (chunk_bytes < 4096 || chunk_bytes % 4096 != 0)
    return bad("chunk_bytes (RESILIENT_CHUNK_BYTES) must be a positive multiple of 4096, got " +
               std::to_string(chunk_bytes));
  if (zstd_level < 0 || zstd_level > 22)
    return outside("zstd_level", "RESILIENT_ZSTD_LEVEL", zstd_level, 0, 22);
  if (copy_threads < 1 || copy_threads > 256)
    return outside("copy_threads", "RESILIENT_COPY_THREADS", copy_threads, 1, 256);
  if (restore_threads < 0 || restore_threads > 256)
    return outside("restore_threads (0: automatic)", "RESILIENT_RESTORE_THREADS", restore_threads,
                   0, 256);
  if (files_per_rank < 1 || files_per_rank > 64)
    return outside("files_per_rank", "RESILIENT_FILES_PER_RANK", files_per_rank, 1, 64);
  if (background_nice < 0 || background_nice > 19)
    return outside("background_nice", "RESILIENT_BACKGROUND_NICE", background_nice, 0, 19);
  if (auto cpus = parse_cpu_list(background_cpus); !cpus.ok()) {
    return bad("background_cpus (RESILIENT_BACKGROUND_CPUS): " + cpus.status().message());
  }
  if (timeout <= Duration::zero())
    return bad("timeout (RESILIENT_CKPT_TIMEOUT_S) must be > 0, got " +
               std::to_string(to_seconds(timeout)));
  // A slab holds whole chunks (create() rounds it up); a budget below one slab fails every save.
  const uint64_t slab = io::align_up(std::max(pool.slab_bytes, chunk_bytes), chunk_bytes);
  if (pool.budget_bytes != 0 && pool.budget_bytes < slab) {  // 0: half of physical memory
    return bad("pool_bytes (RESILIENT_POOL_BYTES) is " + std::to_string(pool.budget_bytes) +
               " bytes, less than one host buffer slab of " + std::to_string(slab) +
               " bytes (slab_bytes rounded up to chunk_bytes): every save would fail");
  }
  return io.validate();
}

Status SaveHandle::wait_snapshot(Duration timeout) const {
  return copies_ ? copies_->wait_all(timeout) : ok_status();
}

bool SaveHandle::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

Status SaveHandle::wait(Duration timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [this] { return done_; })) {
    return Status(StatusCode::kTimeout, "checkpoint of step " + std::to_string(step_) +
                                            " not durable within " +
                                            std::to_string(to_seconds(timeout)) + " s");
  }
  return status_;
}

SaveStats SaveHandle::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void SaveHandle::finish(Status status, SaveStats stats) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = std::move(status);
    stats_ = stats;
  }
  cv_.notify_all();
}

Checkpointer::Checkpointer(CheckpointOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<Checkpointer>> Checkpointer::create(CheckpointOptions options,
                                                           std::shared_ptr<memory::HostPool> pool) {
  RESILIENT_RETURN_IF_ERROR(options.validate());
  RESILIENT_ASSIGN_OR_RETURN(int64_t streams,
                             env_value<int64_t>("RESILIENT_COPY_STREAMS", 4, parse_int));
  if (streams < 1 || streams > 64) {
    return Status(StatusCode::kInvalidArgument,
                  "RESILIENT_COPY_STREAMS must be in [1, 64], got " + std::to_string(streams));
  }
  // The root is created by the first save (prepare_tmp_dir), never by opening: a reader that
  // mistyped the root must not leave an empty one behind.
  std::unique_ptr<Checkpointer> c(new Checkpointer(std::move(options)));
  // Slabs must hold whole chunks: round the slab size up to a multiple of the chunk size.
  auto pool_opts = c->options_.pool;
  pool_opts.slab_bytes = std::max(pool_opts.slab_bytes, c->options_.chunk_bytes);
  pool_opts.slab_bytes = io::align_up(pool_opts.slab_bytes, c->options_.chunk_bytes);
  if (pool != nullptr && pool->slab_bytes() % c->options_.chunk_bytes != 0) {
    return Status(StatusCode::kInvalidArgument,
                  "the shared host pool's slabs (" + std::to_string(pool->slab_bytes()) +
                      " bytes) do not hold whole chunks of " +
                      std::to_string(c->options_.chunk_bytes) + " bytes");
  }
  c->pool_ = pool != nullptr ? std::move(pool) : std::make_shared<memory::HostPool>(pool_opts);
  // The copy workers are on the snapshot's critical path; the writer and the checksum threads
  // are background work, lowered in priority and optionally kept off the training cores.
  const auto copy_threads = static_cast<size_t>(c->options_.copy_threads);
  const std::vector<int> cpus = *parse_cpu_list(c->options_.background_cpus);  // validated
  c->workers_ = std::make_unique<ThreadPool>(copy_threads, ThreadSetup{"rs-ckpt-copy"});
  c->hashers_ = std::make_unique<ThreadPool>(
      copy_threads, ThreadSetup{"rs-ckpt-hash", c->options_.background_nice, cpus});
  c->streams_ = std::make_unique<DeviceStreams>(
      c->options_.cuda ? c->options_.cuda : memory::CudaRuntime::get(), static_cast<int>(streams));
  RESILIENT_ASSIGN_OR_RETURN(c->engine_, io::IoEngine::create(c->options_.io));
  c->writer_ = std::thread([p = c.get(), cpus] {
    // io-wq workers that io_uring creates for the writer's submissions inherit its CPUs.
    apply_thread_setup({"rs-ckpt-writer", p->options_.background_nice, cpus});
    p->writer_loop();
  });
  return c;
}

Checkpointer::~Checkpointer() {
  Status s = wait_all(options_.timeout);
  if (!s.ok()) RESILIENT_LOG(kError, "closing checkpointer: " << s.to_string());
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

Result<std::shared_ptr<SaveHandle>> Checkpointer::save(int64_t step,
                                                       std::span<const TensorSpec> tensors,
                                                       nlohmann::json values, bool commit,
                                                       SaveMode mode) {
  return enqueue(step, tensors, std::move(values), {}, commit, mode);
}

Result<std::shared_ptr<SaveHandle>> Checkpointer::save_json(int64_t step,
                                                            std::span<const TensorSpec> tensors,
                                                            std::string values_json, bool commit,
                                                            SaveMode mode) {
  if (values_json.empty()) values_json = "{}";
  return enqueue(step, tensors, nlohmann::json::object(), std::move(values_json), commit, mode);
}

Result<std::shared_ptr<SaveHandle>> Checkpointer::enqueue(int64_t step,
                                                          std::span<const TensorSpec> tensors,
                                                          nlohmann::json values,
                                                          std::string values_json, bool commit,
                                                          SaveMode mode) {
  if (step < 0) return Status(StatusCode::kInvalidArgument, "step must be >= 0");
  const TimePoint start = SteadyClock::instance().now();
  auto staging = snapshot(tensors, *pool_, *workers_, options_.chunk_bytes, options_.timeout,
                          streams_.get(), options_.copy_group_bytes);
  if (!staging.ok()) return Status(staging.status()).prepend("saving step " + std::to_string(step));
  const double issue_s = to_seconds(SteadyClock::instance().now() - start);
  auto handle = std::make_shared<SaveHandle>(step, staging->copies);
  if (mode == SaveMode::kBlocking) {
    Status copied = handle->wait_snapshot(options_.timeout);
    if (!copied.ok()) return copied.prepend("saving step " + std::to_string(step));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Job{step, std::move(staging).value(), std::move(values),
                         std::move(values_json), commit, handle, start, issue_s,
                         to_seconds(SteadyClock::instance().now() - start)});
    pending_.push_back(handle);
  }
  cv_.notify_all();
  return handle;
}

Result<Staging> Checkpointer::stage(std::span<const TensorSpec> tensors) {
  auto staging = snapshot(tensors, *pool_, *workers_, options_.chunk_bytes, options_.timeout,
                          streams_.get(), options_.copy_group_bytes);
  if (!staging.ok()) return Status(staging.status()).prepend("staging");
  if (staging->copies) {
    RESILIENT_RETURN_IF_ERROR(staging->copies->wait_all(options_.timeout).prepend("staging"));
    staging->copies.reset();  // complete: the slabs need neither events nor quarantine
    staging->streams = nullptr;
  }
  return staging;
}

Result<std::shared_ptr<SaveHandle>> Checkpointer::save_staged(int64_t step, Staging staging,
                                                              nlohmann::json values, bool commit) {
  if (step < 0) return Status(StatusCode::kInvalidArgument, "step must be >= 0");
  if (staging.copies != nullptr || staging.slab_bytes != pool_->slab_bytes() ||
      std::any_of(staging.slabs.begin(), staging.slabs.end(),
                  [this](const memory::Slab& s) { return s.owner() != pool_.get(); })) {
    return Status(StatusCode::kInvalidArgument,
                  "saving step " + std::to_string(step) +
                      ": the staging was not made by stage() of a checkpointer sharing this "
                      "one's host pool");
  }
  const TimePoint start = SteadyClock::instance().now();
  auto handle = std::make_shared<SaveHandle>(step, nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(
        Job{step, std::move(staging), std::move(values), {}, commit, handle, start, 0, 0});
    pending_.push_back(handle);
  }
  cv_.notify_all();
  return handle;
}

Status Checkpointer::close(Duration timeout) {
  Status s = wait_all(timeout);
  // A pool shared with another checkpointer (the DCP writer hands it from engine to engine) or
  // held by a staging stays as it is: its slabs are pinned once and reused.
  if (pool_.use_count() == 1) pool_->trim();
  return s;
}

Status Checkpointer::wait_all(Duration timeout) {
  std::vector<std::shared_ptr<SaveHandle>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending = pending_;
  }
  const TimePoint deadline = SteadyClock::instance().now() + timeout;
  Status first;
  for (const auto& h : pending) {
    Status s = h->wait(std::max(deadline - SteadyClock::instance().now(), Duration::zero()));
    if (!s.ok() && first.ok()) first = s;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [this] { return !busy_ && queue_.empty(); }) && first.ok()) {
    first = Status(StatusCode::kTimeout, "checkpoint writer still busy");
  }
  return first;
}

void Checkpointer::writer_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    SaveStats stats;
    stats.issue_s = job.issue_s;
    stats.snapshot_s = job.snapshot_s;
    Status s = write_job(job, stats);
    if (!s.ok()) {
      s.prepend("saving step " + std::to_string(job.step));
      // Returned through the save's handle and raised by Python: not printed here too.
      RESILIENT_LOG(kDebug, s.to_string());
      job.staging.release_slabs();  // those with copies still pending stay out of the pool
      if (job.commit) (void)io::remove_tree(tmp_dir_path(options_.root, job.step));
    }
    {
      // Atomically for wait_all(): once a caller sees this save end, wait_all() no longer
      // reports it (close() raised a failure the caller had already seen from wait()).
      std::lock_guard<std::mutex> lock(mu_);
      std::erase(pending_, job.handle);
      job.handle->finish(s, stats);
    }
    if (s.ok() && job.commit) {
      auto deleted = apply_retention(options_.root, options_.keep);
      if (!deleted.ok())
        RESILIENT_LOG(kWarn, "checkpoint retention: " << deleted.status().to_string());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

Status Checkpointer::write_job(Job& job, SaveStats& stats) {
  if (!job.values_json.empty()) {
    job.values = nlohmann::json::parse(job.values_json, nullptr, false);
    if (job.values.is_discarded())
      return Status(StatusCode::kInvalidArgument, "the values are not valid JSON");
    std::string().swap(job.values_json);
  }
  // Every file of the save is opened relative to this directory, never through a link.
  RESILIENT_ASSIGN_OR_RETURN(io::Dir dir, prepare_tmp_dir(options_.root, job.step, job.commit));
  // The further data files' engines, made by the first save (a checkpointer that only reads
  // never holds them). Compressed images are one file (persist_files).
  const int files = options_.zstd_level == 0 ? options_.files_per_rank : 1;
  if (options_.files_per_rank > 1 && options_.zstd_level > 0) {
    log_once("ckpt-files-per-rank-zstd", LogLevel::kInfo,
             "files_per_rank is ignored for compressed saves (zstd_level > 0): one data file");
  }
  while (static_cast<int>(file_engines_.size()) + 1 < files) {
    RESILIENT_ASSIGN_OR_RETURN(auto e, io::IoEngine::create(options_.io));
    file_engines_.push_back(std::move(e));
    registered_epoch_ = ~0ull;  // register the slabs with the new engine too
  }
  // Register the pool's slabs as io_uring fixed buffers (saves pinning pages per request);
  // again whenever the pool allocated or freed slabs since the last registration.
  if (pool_->epoch() != registered_epoch_) {
    std::vector<iovec> iov;
    for (auto [p, n] : pool_->slabs()) iov.push_back(iovec{p, n});
    Status r = engine_->register_buffers(iov);
    if (!r.ok())
      log_once("ckpt-register-buffers", LogLevel::kInfo,
               "fixed buffers not registered: " + r.to_string());
    for (auto& e : file_engines_) (void)e->register_buffers(iov);  // logged once above if refused
    registered_epoch_ = pool_->epoch();
  }
  PersistOptions po;
  po.zstd_level = options_.zstd_level;
  po.direct = options_.io.direct;
  po.timeout = options_.timeout;
  Manifest m;
  if (file_engines_.empty()) {
    const std::string file = shard_file_name(options_.rank);
    RESILIENT_ASSIGN_OR_RETURN(uint64_t size,
                               persist_shard(job.staging, dir, file, po, *engine_, *hashers_));
    m.shards.push_back(ShardEntry{options_.rank, file, size});
  } else {
    std::vector<std::string> names;
    std::vector<io::IoEngine*> engines{engine_.get()};
    for (auto& e : file_engines_) engines.push_back(e.get());
    for (size_t i = 0; i < engines.size(); ++i)
      names.push_back(shard_file_name(options_.rank, static_cast<int>(i)));
    RESILIENT_ASSIGN_OR_RETURN(auto files,
                               persist_files(job.staging, dir, names, po, engines, *hashers_));
    for (auto& f : files) m.shards.push_back(ShardEntry{options_.rank, f.name, f.bytes});
  }
  stats.written_s = to_seconds(SteadyClock::instance().now() - job.started);
  m.step = job.step;
  m.world_size = options_.world_size;
  m.tensors = std::move(job.staging.layout.tensors);
  for (const auto& t : m.tensors) {
    stats.bytes += t.nbytes;
    for (const auto& c : t.chunks) stats.stored_bytes += c.len;
  }
  m.values = std::move(job.values);
  m.meta = {{"io_backend", engine_->name()}, {"zstd_level", options_.zstd_level}};
  if (job.commit) {
    RESILIENT_RETURN_IF_ERROR(commit_step(options_.root, m));
  } else {
    const std::string name = "rank-" + std::to_string(options_.rank) + ".json";
    // The commit fsyncs this directory after it wrote the merged manifest (commit.cpp).
    RESILIENT_RETURN_IF_ERROR(io::write_file_atomic_at(dir, name, to_json(m), io::Sync::kFile));
  }
  stats.durable_s = to_seconds(SteadyClock::instance().now() - job.started);
  return ok_status();
}

Result<std::vector<int64_t>> Checkpointer::steps() const { return committed_steps(options_.root); }

Result<Manifest> Checkpointer::manifest(int64_t step) const {
  return read_manifest(options_.root, step);
}

int Checkpointer::reader_threads(int local_ranks) const {
  return restore_threads(options_.restore_threads, local_ranks);
}

Status Checkpointer::read(const Manifest& m, std::span<const ReadTarget> targets,
                          const ReadSharing& sharing) {
  RestoreOptions ro;
  ro.queue = sharing.queue;
  ro.bytes_read = sharing.bytes_read;
  ro.threads = sharing.threads > 0 ? sharing.threads : reader_threads(sharing.local_ranks);
  ro.io = options_.io;
  ro.timeout = options_.timeout;
  ro.cuda = streams_->cuda();
  return restore_tensors(step_dir_path(options_.root, m.step), m, targets, ro, *pool_);
}

Status Checkpointer::verify(const Manifest& m) {
  RestoreOptions ro;
  ro.threads = restore_threads(options_.restore_threads);
  ro.io = options_.io;
  ro.timeout = options_.timeout;
  return verify_step(step_dir_path(options_.root, m.step), m, ro, *pool_);
}

}  // namespace resilient::checkpoint
