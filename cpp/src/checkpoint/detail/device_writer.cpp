#include "checkpoint/detail/device_writer.hpp"

#include <chrono>

namespace resilient::checkpoint::detail {

DeviceWriter::DeviceWriter(const memory::CudaRuntime* cuda, size_t buffers)
    : cuda_(cuda), used_(buffers), pending_(buffers) {}

DeviceWriter::~DeviceWriter() {
  if (cuda_ == nullptr) return;
  for (size_t buf = 0; buf < used_.size(); ++buf) (void)close(buf);
  for (auto& pending : pending_) (void)wait(pending);
  for (auto [device, stream] : streams_) {
    (void)cuda_->set_device(device);
    (void)cuda_->stream_destroy(stream);
  }
}

Status DeviceWriter::copy(int device, void* dst, const void* src, uint64_t n, size_t buf) {
  if (cuda_ == nullptr)
    return Status(StatusCode::kUnavailable, "device target but no CUDA runtime");
  RESILIENT_ASSIGN_OR_RETURN(memory::StreamHandle stream, stream_for(device));
  RESILIENT_RETURN_IF_ERROR(
      cuda_->memcpy_async(dst, src, n, memory::CopyKind::kHostToDevice, stream));
  used_[buf].emplace_back(device, stream);
  return ok_status();
}

Status DeviceWriter::close(size_t buf) {
  for (auto [device, stream] : used_[buf]) {
    // An event belongs to the device current at its creation and must be recorded on a stream
    // of that device.
    RESILIENT_RETURN_IF_ERROR(cuda_->set_device(device));
    memory::EventHandle e = 0;
    RESILIENT_RETURN_IF_ERROR(cuda_->event_create(&e));
    pending_[buf].push_back(e);
    RESILIENT_RETURN_IF_ERROR(cuda_->event_record(e, stream));
  }
  used_[buf].clear();
  return ok_status();
}

Status DeviceWriter::reuse(size_t buf) { return wait(pending_[buf]); }

Status DeviceWriter::drain() {
  Status first;
  for (auto& pending : pending_) {
    Status s = wait(pending);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

Result<memory::StreamHandle> DeviceWriter::stream_for(int device) {
  RESILIENT_RETURN_IF_ERROR(cuda_->set_device(device));
  for (auto [d, s] : streams_) {
    if (d == device) return s;
  }
  memory::StreamHandle s = 0;
  RESILIENT_RETURN_IF_ERROR(cuda_->stream_create(&s));
  streams_.emplace_back(device, s);
  return s;
}

Status DeviceWriter::wait(std::vector<memory::EventHandle>& events) {
  Status first;
  for (auto e : events) {
    Status s = cuda_->event_wait(e, std::chrono::seconds(600));
    if (!s.ok() && first.ok()) first = s;
    (void)cuda_->event_destroy(e);
  }
  events.clear();
  return first;
}

}  // namespace resilient::checkpoint::detail
