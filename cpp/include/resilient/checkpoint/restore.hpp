#pragma once
// Restore: reads the chunks of the requested tensors in parallel (one io engine per reader
// thread, large coalesced O_DIRECT reads into pool slabs), verifies every chunk's checksum, and
// decodes it straight into the caller's buffers as soon as its bytes are in (while the reader's
// later requests are still in flight). Chunks of host targets whose pages are all in the page
// cache are read from there instead (RestoreOptions::page_cache).

#include <cstdint>
#include <span>
#include <string>

#include "resilient/checkpoint/format.hpp"
#include "resilient/common/clock.hpp"
#include "resilient/common/status.hpp"
#include "resilient/io/engine.hpp"
#include "resilient/memory/cuda.hpp"
#include "resilient/memory/pool.hpp"

namespace resilient::checkpoint {

/// A destination for one saved tensor: `nbytes` writable bytes at `dst`, in host memory
/// (device -1) or on a CUDA device (copied host-to-device from the pool's pinned slabs).
/// `done` (host targets only; 8-byte aligned, may lie in memory other processes map; 0 before
/// the read): counts the tensor's chunks in place (2 each) and is made odd, with release
/// ordering, once every chunk is verified and in place, while the other targets of the call are
/// still being read (a shared restore's ranks copy it out then). Counted in the word itself, so
/// that processes sharing a queue (RestoreOptions::queue) complete one tensor together.
struct ReadTarget {
  std::string name;
  void* dst = nullptr;
  uint64_t nbytes = 0;
  int device = -1;
  int64_t* done = nullptr;
  // A host target in a shared mapping whose pages may not exist yet (the shared restore's
  // /dev/shm buffer): each chunk's pages are allocated before it is written, by the reader
  // thread that writes it, so that a full tmpfs fails the read (kResourceExhausted) instead of
  // raising SIGBUS, and the allocation runs beside the reads.
  bool populate = false;
};

struct RestoreOptions {
  int threads = 4;  // RESILIENT_RESTORE_THREADS
  io::IoOptions io;
  Duration timeout = std::chrono::seconds(600);
  const memory::CudaRuntime* cuda = nullptr;  // needed for device targets
  // Two int64 words (8-byte aligned, 0 before the first reader starts) in memory that several
  // processes map, each reading the same targets (by name, size and order) into one shared
  // buffer: the reads' extents are claimed through queue[0] by whichever thread of whichever
  // process is free, so the processes finish together however unevenly the storage serves
  // them. queue[1] holds the first process's plan fingerprint: a process whose plan differs
  // (other settings; the caller should give every process one thread count) claims nothing and
  // returns OK, with a warning, having read nothing: the others read it all, and the caller waits
  // for the done words as always. A process that fails closes the queue: the others stop
  // claiming.
  int64_t* queue = nullptr;
  // Out: the bytes of the targets this process read (the tensors' bytes, not the file's).
  uint64_t* bytes_read = nullptr;
  // Take a chunk of a host target from the page cache when all its pages are there (a restart
  // on the same host), instead of reading it O_DIRECT from the device; chunk by chunk, the rest
  // from the device (io/page_cache.hpp). Checksums are verified either way.
  bool page_cache = true;
  // Out: the bytes of the targets this process took from the page cache (part of bytes_read).
  uint64_t* bytes_cached = nullptr;
};

/// Reads every target from the step directory `step_dir` described by `manifest`. Errors:
/// kNotFound (tensor not in the checkpoint, missing shard file), kInvalidArgument (size mismatch
/// with the target), kCorrupt (checksum mismatch, truncated file, bad compressed data: names the
/// file and offset), kIoError, kTimeout. On error the targets hold unspecified bytes.
Status restore_tensors(const std::string& step_dir, const Manifest& manifest,
                       std::span<const ReadTarget> targets, const RestoreOptions& options,
                       memory::HostPool& pool);

/// Reads and verifies every chunk of the step without keeping the data (full integrity check).
Status verify_step(const std::string& step_dir, const Manifest& manifest,
                   const RestoreOptions& options, memory::HostPool& pool);

}  // namespace resilient::checkpoint
