#include "resilient/memory/cuda.hpp"

#include <dlfcn.h>

#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "memory/detail/cuda_table.hpp"
#include "resilient/common/logging.hpp"

namespace resilient::memory {
namespace detail {
namespace {

template <typename Fn>
bool resolve(void* lib, const char* symbol, Fn& fn, std::string& missing) {
  fn = reinterpret_cast<Fn>(::dlsym(lib, symbol));
  if (fn == nullptr) missing = symbol;
  return fn != nullptr;
}

CudaLoad load_or_reason(const std::string& path_override) {
  std::vector<std::string> candidates;
  if (!path_override.empty()) {
    candidates.push_back(path_override);
  } else {
    for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
      candidates.emplace_back(name);
      candidates.push_back(std::string("/usr/local/cuda/lib64/") + name);
    }
  }
  void* lib = nullptr;
  std::string tried;
  for (const std::string& c : candidates) {
    lib = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    tried += (tried.empty() ? "" : ", ") + c;
  }
  CudaLoad out;
  if (lib == nullptr) {
    out.reason = "libcudart not found (tried " + tried + ")";
    return out;
  }
  auto* t = new CudaRuntime::Table();
  std::string missing;
  bool ok = resolve(lib, "cudaGetDeviceCount", t->get_device_count, missing) &&
            resolve(lib, "cudaSetDevice", t->set_device, missing) &&
            resolve(lib, "cudaGetDevice", t->get_device, missing) &&
            resolve(lib, "cudaHostAlloc", t->host_alloc, missing) &&
            resolve(lib, "cudaFreeHost", t->free_host, missing) &&
            resolve(lib, "cudaHostRegister", t->host_register, missing) &&
            resolve(lib, "cudaHostUnregister", t->host_unregister, missing) &&
            resolve(lib, "cudaMemcpyAsync", t->memcpy_async, missing) &&
            resolve(lib, "cudaStreamCreateWithFlags", t->stream_create_with_flags, missing) &&
            resolve(lib, "cudaStreamDestroy", t->stream_destroy, missing) &&
            resolve(lib, "cudaEventCreateWithFlags", t->event_create_with_flags, missing) &&
            resolve(lib, "cudaEventDestroy", t->event_destroy, missing) &&
            resolve(lib, "cudaEventRecord", t->event_record, missing) &&
            resolve(lib, "cudaStreamWaitEvent", t->stream_wait_event, missing) &&
            resolve(lib, "cudaEventQuery", t->event_query, missing) &&
            resolve(lib, "cudaStreamSynchronize", t->stream_synchronize, missing) &&
            resolve(lib, "cudaGetErrorString", t->get_error_string, missing) &&
            resolve(lib, "cudaGetLastError", t->get_last_error, missing);
  if (!ok) {
    delete t;
    ::dlclose(lib);
    out.reason = "libcudart lacks " + missing;
    return out;
  }
  // Optional: one call queues a slab's copies (CUDA 13's signature; older runtimes copy one
  // by one).
  using Version = int (*)(int*);
  auto version = reinterpret_cast<Version>(::dlsym(lib, "cudaRuntimeGetVersion"));
  int v = 0;
  if (env_bool("RESILIENT_COPY_BATCH", true) && version != nullptr && version(&v) == kCudaSuccess &&
      v >= kFirstBatchRuntime) {
    t->memcpy_batch_async =
        reinterpret_cast<decltype(t->memcpy_batch_async)>(::dlsym(lib, "cudaMemcpyBatchAsync"));
  }
  int count = 0;
  int err = t->get_device_count(&count);
  if (err != kCudaSuccess || count <= 0) {
    out.reason = err != kCudaSuccess ? std::string("no usable CUDA device: cudaGetDeviceCount: ") +
                                           t->get_error_string(err)
                                     : std::string("no CUDA device visible");
    delete t;  // the library stays loaded: unloading cudart after use is not safe
    return out;
  }
  out.table = t;
  return out;
}

}  // namespace

CudaLoad load_cuda_runtime(Feature mode, const std::string& path_override) {
  if (mode == Feature::kOff) return CudaLoad{nullptr, "CUDA disabled (RESILIENT_CUDA=off)"};
  CudaLoad load = load_or_reason(path_override);
  if (load.table == nullptr && mode == Feature::kOn) {
    throw std::runtime_error("RESILIENT_CUDA=on but CUDA is unusable: " + load.reason);
  }
  return load;
}

}  // namespace detail

namespace {

struct Loaded {
  const CudaRuntime* runtime = nullptr;
  std::string reason;
};

const Loaded& loaded() {
  static const Loaded* l = [] {
    auto* out = new Loaded();
    detail::CudaLoad load =
        detail::load_cuda_runtime(env_feature("RESILIENT_CUDA", Feature::kAuto),
                                  env_string("RESILIENT_CUDART_PATH").value_or(""));
    if (load.table != nullptr) {
      out->runtime = new CudaRuntime(load.table);
    } else {
      out->reason = load.reason;
      log_once("memory.cuda_unavailable", LogLevel::kInfo,
               "CUDA runtime not used: " + load.reason + " (host memory is not pinned)");
    }
    return out;
  }();
  return *l;
}

}  // namespace

const CudaRuntime* CudaRuntime::get() { return loaded().runtime; }
const char* CudaRuntime::unavailable_reason() { return loaded().reason.c_str(); }

namespace {

Status cuda_status(const CudaRuntime::Table* t, int err, const char* what) {
  if (err == detail::kCudaSuccess) return ok_status();
  const char* text = t->get_error_string != nullptr ? t->get_error_string(err) : "unknown";
  StatusCode code = err == detail::kCudaErrorMemoryAllocation ? StatusCode::kResourceExhausted
                                                              : StatusCode::kInternal;
  return Status(code, std::string(what) + ": CUDA error " + std::to_string(err) + " (" +
                          (text != nullptr ? text : "?") + ")");
}

void* as_ptr(uintptr_t h) { return reinterpret_cast<void*>(h); }

int copy_kind(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return 1;
    case CopyKind::kDeviceToHost:
      return 2;
    case CopyKind::kDeviceToDevice:
      return 3;
    case CopyKind::kDefault:
      return 4;
  }
  return 4;
}

}  // namespace

int CudaRuntime::device_count() const {
  int n = 0;
  return t_->get_device_count(&n) == detail::kCudaSuccess ? n : 0;
}

DeviceGuard::DeviceGuard(const CudaRuntime* cuda) : cuda_(cuda) {
  if (cuda_ == nullptr) return;
  auto d = cuda_->get_device();
  if (d.ok()) device_ = *d;
}

DeviceGuard::~DeviceGuard() {
  if (cuda_ == nullptr || device_ < 0) return;
  // Only when it changed: cudaSetDevice creates the device's context if there is none yet.
  auto now = cuda_->get_device();
  if (!now.ok() || *now != device_) (void)cuda_->set_device(device_);
}

Status CudaRuntime::set_device(int device) const {
  return cuda_status(t_, t_->set_device(device), "cudaSetDevice");
}

Result<int> CudaRuntime::get_device() const {
  int d = -1;
  RESILIENT_RETURN_IF_ERROR(cuda_status(t_, t_->get_device(&d), "cudaGetDevice"));
  return d;
}

Status CudaRuntime::host_alloc(void** ptr, size_t bytes) const {
  return cuda_status(t_, t_->host_alloc(ptr, bytes, detail::kCudaHostAllocPortable),
                     "cudaHostAlloc");
}

Status CudaRuntime::host_free(void* ptr) const {
  return cuda_status(t_, t_->free_host(ptr), "cudaFreeHost");
}

Status CudaRuntime::host_register(void* ptr, size_t bytes) const {
  return cuda_status(t_, t_->host_register(ptr, bytes, detail::kCudaHostRegisterPortable),
                     "cudaHostRegister");
}

Status CudaRuntime::host_unregister(void* ptr) const {
  return cuda_status(t_, t_->host_unregister(ptr), "cudaHostUnregister");
}

Status CudaRuntime::memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind,
                                 StreamHandle stream) const {
  return cuda_status(t_, t_->memcpy_async(dst, src, bytes, copy_kind(kind), as_ptr(stream)),
                     "cudaMemcpyAsync");
}

Status CudaRuntime::memcpy_batch_async(std::span<const DeviceCopy> copies, CopyKind kind,
                                       StreamHandle stream) const {
  // Not on the legacy default stream (the batch call refuses it), and not for one copy.
  if (copies.size() > 1 && stream != 0 && t_->memcpy_batch_async != nullptr &&
      batch_.load(std::memory_order_relaxed)) {
    std::vector<void*> dsts(copies.size());
    std::vector<const void*> srcs(copies.size());
    std::vector<size_t> sizes(copies.size());
    for (size_t i = 0; i < copies.size(); ++i) {
      dsts[i] = copies[i].dst;
      srcs[i] = copies[i].src;
      sizes[i] = copies[i].bytes;
    }
    detail::MemcpyAttributes attrs;  // every copy reads its source in stream order
    size_t first = 0;
    int err = t_->memcpy_batch_async(dsts.data(), srcs.data(), sizes.data(), copies.size(), &attrs,
                                     &first, 1, as_ptr(stream));
    if (err == detail::kCudaSuccess) return ok_status();
    // The refusal is also the thread's last error, and this is the caller's (PyTorch's) thread:
    // left there, torch's next launch check would report it against an unrelated kernel.
    if (t_->get_last_error != nullptr) (void)t_->get_last_error();
    // Copying again is harmless: the same bytes to the same place, in stream order.
    batch_.store(false, std::memory_order_relaxed);
    log_once("memory.cuda_batch_failed", LogLevel::kWarn,
             cuda_status(t_, err, "cudaMemcpyBatchAsync").to_string() +
                 "; copies are queued one by one from now on");
  }
  for (const DeviceCopy& c : copies) {
    RESILIENT_RETURN_IF_ERROR(memcpy_async(c.dst, c.src, c.bytes, kind, stream));
  }
  return ok_status();
}

bool CudaRuntime::batches_copies() const {
  return t_->memcpy_batch_async != nullptr && batch_.load(std::memory_order_relaxed);
}

Status CudaRuntime::stream_create(StreamHandle* stream) const {
  void* s = nullptr;
  RESILIENT_RETURN_IF_ERROR(cuda_status(
      t_, t_->stream_create_with_flags(&s, detail::kCudaStreamNonBlocking), "cudaStreamCreate"));
  *stream = reinterpret_cast<StreamHandle>(s);
  return ok_status();
}

Status CudaRuntime::stream_destroy(StreamHandle stream) const {
  return cuda_status(t_, t_->stream_destroy(as_ptr(stream)), "cudaStreamDestroy");
}

Status CudaRuntime::event_create(EventHandle* event) const {
  void* e = nullptr;
  RESILIENT_RETURN_IF_ERROR(cuda_status(
      t_, t_->event_create_with_flags(&e, detail::kCudaEventDisableTiming), "cudaEventCreate"));
  *event = reinterpret_cast<EventHandle>(e);
  return ok_status();
}

Status CudaRuntime::event_destroy(EventHandle event) const {
  return cuda_status(t_, t_->event_destroy(as_ptr(event)), "cudaEventDestroy");
}

Status CudaRuntime::event_record(EventHandle event, StreamHandle stream) const {
  return cuda_status(t_, t_->event_record(as_ptr(event), as_ptr(stream)), "cudaEventRecord");
}

Status CudaRuntime::stream_wait_event(StreamHandle stream, EventHandle event) const {
  return cuda_status(t_, t_->stream_wait_event(as_ptr(stream), as_ptr(event), 0),
                     "cudaStreamWaitEvent");
}

Result<bool> CudaRuntime::event_query(EventHandle event) const {
  int err = t_->event_query(as_ptr(event));
  if (err == detail::kCudaErrorNotReady) return false;
  RESILIENT_RETURN_IF_ERROR(cuda_status(t_, err, "cudaEventQuery"));
  return true;
}

Status CudaRuntime::event_wait(EventHandle event, Duration timeout) const {
  // Polls with a short backoff: cudaEventSynchronize has no timeout.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    RESILIENT_ASSIGN_OR_RETURN(bool done, event_query(event));
    if (done) return ok_status();
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status(StatusCode::kTimeout,
                    "CUDA event not complete within " + std::to_string(to_seconds(timeout)) + " s");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

Status CudaRuntime::stream_synchronize(StreamHandle stream) const {
  return cuda_status(t_, t_->stream_synchronize(as_ptr(stream)), "cudaStreamSynchronize");
}

}  // namespace resilient::memory
