// resilient._C I/O helpers for the benchmark CLI's `raw` row: plain writes and reads of a file
// from pool slabs through the real engine (io_uring + O_DIRECT where available), and a page-cache
// drop so restores are measured from storage.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "errors.hpp"
#include "register.hpp"
#include "resilient/io/engine.hpp"
#include "resilient/io/fault_env.hpp"
#include "resilient/io/file_hooks.hpp"
#include "resilient/io/file.hpp"
#include "resilient/common/logging.hpp"
#include "resilient/memory/pool.hpp"

namespace resilient::py {
namespace pyb = pybind11;

namespace {

struct RawResult {
  double seconds = 0;
  std::string engine;
  bool direct = false;
  bool registered = false;
  uint64_t bytes = 0;
};

struct RawSetup {
  io::IoOptions io;
  std::unique_ptr<io::IoEngine> engine;
  std::unique_ptr<memory::HostPool> pool;
  std::vector<memory::Slab> slabs;
  bool registered = false;
};

// An engine plus `buffer_bytes` of slabs (one slab per request, cycled over the file).
Result<RawSetup> make_setup(uint64_t request_bytes, int queue_depth, const std::string& uring,
                            const std::string& direct, uint64_t buffer_bytes) {
  RawSetup s;
  RESILIENT_ASSIGN_OR_RETURN(s.io, io::IoOptions::from_env());
  s.io.request_bytes = request_bytes;
  s.io.queue_depth = queue_depth;
  RESILIENT_ASSIGN_OR_RETURN(s.io.uring, parse_feature(uring));
  RESILIENT_ASSIGN_OR_RETURN(s.io.direct, parse_feature(direct));
  RESILIENT_RETURN_IF_ERROR(s.io.validate());
  RESILIENT_ASSIGN_OR_RETURN(s.engine, io::IoEngine::create(s.io));
  RESILIENT_ASSIGN_OR_RETURN(memory::PoolOptions po, memory::PoolOptions::from_env());
  po.slab_bytes = request_bytes;
  po.budget_bytes = std::max<uint64_t>(io::align_up(buffer_bytes, request_bytes), request_bytes);
  s.pool = std::make_unique<memory::HostPool>(po);
  const uint64_t n = po.budget_bytes / request_bytes;
  for (uint64_t i = 0; i < n; ++i) {
    RESILIENT_ASSIGN_OR_RETURN(auto slab, s.pool->acquire(std::chrono::seconds(60)));
    s.slabs.push_back(std::move(slab));
  }
  std::vector<iovec> iov;
  for (auto& [p, len] : s.pool->slabs()) iov.push_back(iovec{p, len});
  // Optional: unregistered buffers work too. The thread engine has nothing to register.
  s.registered =
      std::string(s.engine->name()) == "io_uring" && s.engine->register_buffers(iov).ok();
  return s;
}

// Requests covering [0, bytes) in request_bytes pieces, cycling over the slabs.
std::vector<io::IoRequest> plan(RawSetup& s, uint64_t bytes) {
  std::vector<io::IoRequest> reqs;
  size_t k = 0;
  for (uint64_t off = 0; off < bytes; off += s.io.request_bytes, ++k) {
    const uint64_t len = std::min(s.io.request_bytes, bytes - off);
    reqs.push_back(io::IoRequest{s.slabs[k % s.slabs.size()].data(), len, off});
  }
  return reqs;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Result<RawResult> raw_write(const std::string& path, uint64_t nbytes, uint64_t request_bytes,
                            int queue_depth, const std::string& uring, const std::string& direct,
                            uint64_t buffer_bytes, double timeout_s) {
  RESILIENT_ASSIGN_OR_RETURN(RawSetup s,
                             make_setup(request_bytes, queue_depth, uring, direct, buffer_bytes));
  for (size_t i = 0; i < s.slabs.size(); ++i) {  // non-zero, varying content
    auto* words = reinterpret_cast<uint64_t*>(s.slabs[i].data());
    for (uint64_t w = 0; w < s.slabs[i].size() / 8; ++w) words[w] = (w + i) * 0x9E3779B97F4A7C15ull;
  }
  const auto t0 = std::chrono::steady_clock::now();
  RESILIENT_ASSIGN_OR_RETURN(io::File f, io::File::create(path, s.io.direct));
  // Direct files need whole blocks: write the padded size, then cut the file to nbytes.
  const uint64_t padded = f.direct() ? io::align_up(nbytes) : nbytes;
  auto reqs = plan(s, padded);
  RESILIENT_RETURN_IF_ERROR(s.engine->write(f, reqs, from_seconds(timeout_s)));
  if (padded != nbytes) RESILIENT_RETURN_IF_ERROR(f.truncate(nbytes));
  RESILIENT_RETURN_IF_ERROR(f.sync());
  RESILIENT_RETURN_IF_ERROR(f.close());
  return RawResult{since(t0), s.engine->name(), f.direct(), s.registered, nbytes};
}

Result<RawResult> raw_read(const std::string& path, uint64_t request_bytes, int queue_depth,
                           const std::string& uring, const std::string& direct,
                           uint64_t buffer_bytes, double timeout_s) {
  RESILIENT_ASSIGN_OR_RETURN(RawSetup s,
                             make_setup(request_bytes, queue_depth, uring, direct, buffer_bytes));
  const auto t0 = std::chrono::steady_clock::now();
  RESILIENT_ASSIGN_OR_RETURN(io::File f, io::File::open_read(path, s.io.direct));
  RESILIENT_ASSIGN_OR_RETURN(uint64_t size, f.size());
  // On a direct file the unaligned tail cannot be read directly: read it buffered.
  const uint64_t body = f.direct() ? size / io::kDirectAlignment * io::kDirectAlignment : size;
  auto reqs = plan(s, body);
  RESILIENT_RETURN_IF_ERROR(s.engine->read(f, reqs, from_seconds(timeout_s)));
  if (body < size) {
    RESILIENT_ASSIGN_OR_RETURN(io::File tail, io::File::open_read(path, Feature::kOff));
    io::IoRequest r{s.slabs[0].data(), size - body, body};
    RESILIENT_RETURN_IF_ERROR(s.engine->read(tail, {&r, 1}, from_seconds(timeout_s)));
  }
  return RawResult{since(t0), s.engine->name(), f.direct(), s.registered, size};
}

// fdatasync + POSIX_FADV_DONTNEED, then mincore to check the pages really left the cache
// (tmpfs, for one, keeps them). True when no more than 1% of the file stays resident.
bool drop_file_cache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  bool ok = ::fstat(fd, &st) == 0 && ::fdatasync(fd) == 0 &&
            ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
  if (ok && st.st_size > 0) {
    const size_t len = static_cast<size_t>(st.st_size);
    void* map = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
    if (map != MAP_FAILED) {
      const long page = ::sysconf(_SC_PAGESIZE);
      std::vector<unsigned char> vec((len + page - 1) / page);
      if (::mincore(map, len, vec.data()) == 0) {
        size_t resident = 0;
        for (unsigned char v : vec) resident += v & 1;
        ok = resident * 100 <= vec.size();
      }
      ::munmap(map, len);
    }
  }
  ::close(fd);
  return ok;
}

pyb::dict to_dict(const RawResult& r) {
  pyb::dict d;
  d["seconds"] = r.seconds;
  d["engine"] = r.engine;
  d["direct"] = r.direct;
  d["registered"] = r.registered;
  d["bytes"] = r.bytes;
  return d;
}

}  // namespace

void register_io(pyb::module_& m) {
  // Chaos runs give an unmodified job file faults through RESILIENT_FAULT_* (docs/operations.md).
  if (auto spec = io::fault_spec_from_env(); !spec.ok()) {
    RESILIENT_LOG(kError, "file fault injection not installed: " << spec.status().to_string());
  } else if (spec.value().ops != 0) {
    Status st = io::install_fault_hook(spec.value());
    RESILIENT_LOG(kWarn, "file fault injection from RESILIENT_FAULT_*: " << st.to_string());
  }
  m.def(
      "install_fault_hook",
      [](const std::vector<std::string>& ops, int error, const std::string& path_contains,
         int64_t after, int64_t count, const std::string& trigger_file, double delay_ms) {
        io::FaultSpec spec;
        for (int op = 0; op <= static_cast<int>(io::FileOp::kClose); ++op)
          for (const auto& name : ops)
            if (name == io::file_op_name(static_cast<io::FileOp>(op))) spec.ops |= 1u << op;
        if (spec.ops == 0) throw_if_error(Status(StatusCode::kInvalidArgument, "no known op"));
        spec.error = error;
        spec.path_contains = path_contains;
        spec.after = after;
        spec.count = count;
        spec.trigger_file = trigger_file;
        spec.delay_ms = delay_ms;
        throw_if_error(io::install_fault_hook(spec));
      },
      pyb::arg("ops"), pyb::arg("error"), pyb::arg("path_contains") = "", pyb::arg("after") = 0,
      pyb::arg("count") = 0, pyb::arg("trigger_file") = "", pyb::arg("delay_ms") = 0.0,
      "Makes file ops (names as in 'write', 'fsync', 'rename'...) fail with `error` (an errno; "
      "0 only delays by delay_ms) for paths containing `path_contains`, after `after` matching "
      "calls, at most `count` times (0: unlimited), only while `trigger_file` exists if given.");
  m.def("clear_fault_hook", &io::clear_fault_hook,
        "Removes the fault hook; returns how many calls it failed or delayed.");
  m.def("fault_hook_hits", &io::fault_hook_hits, "Calls failed or delayed by the fault hook.");
  m.def(
      "raw_write",
      [](const std::string& path, uint64_t nbytes, uint64_t request_bytes, int queue_depth,
         const std::string& uring, const std::string& direct, uint64_t buffer_bytes,
         double timeout_s) {
        Result<RawResult> r = Status(StatusCode::kInternal, "not run");
        {
          pyb::gil_scoped_release release;
          r = raw_write(path, nbytes, request_bytes, queue_depth, uring, direct, buffer_bytes,
                        timeout_s);
        }
        return to_dict(unwrap(std::move(r)));
      },
      pyb::arg("path"), pyb::arg("nbytes"), pyb::arg("request_bytes") = 16ull << 20,
      pyb::arg("queue_depth") = 8, pyb::arg("uring") = "auto", pyb::arg("direct") = "auto",
      pyb::arg("buffer_bytes") = 256ull << 20, pyb::arg("timeout_s") = 3600.0,
      "Writes `nbytes` to a new file at `path` from host pool slabs with the I/O engine, then "
      "fsyncs and closes it. Returns {seconds, engine, direct, registered, bytes}; seconds "
      "covers open to durable.");
  m.def(
      "raw_read",
      [](const std::string& path, uint64_t request_bytes, int queue_depth, const std::string& uring,
         const std::string& direct, uint64_t buffer_bytes, double timeout_s) {
        Result<RawResult> r = Status(StatusCode::kInternal, "not run");
        {
          pyb::gil_scoped_release release;
          r = raw_read(path, request_bytes, queue_depth, uring, direct, buffer_bytes, timeout_s);
        }
        return to_dict(unwrap(std::move(r)));
      },
      pyb::arg("path"), pyb::arg("request_bytes") = 16ull << 20, pyb::arg("queue_depth") = 8,
      pyb::arg("uring") = "auto", pyb::arg("direct") = "auto",
      pyb::arg("buffer_bytes") = 256ull << 20, pyb::arg("timeout_s") = 3600.0,
      "Reads the whole file at `path` into host pool slabs with the I/O engine. Returns "
      "{seconds, engine, direct, registered, bytes}.");
  m.def("drop_file_cache", &drop_file_cache, pyb::arg("path"),
        pyb::call_guard<pyb::gil_scoped_release>(),
        "Evicts the file's pages from the page cache (fdatasync + POSIX_FADV_DONTNEED). Returns "
        "whether they are gone (False on tmpfs, or if the file cannot be opened).");
}

}  // namespace resilient::py
