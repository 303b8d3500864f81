#include "resilient/io/page_cache.hpp"

#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <utility>
#include <vector>

#include "resilient/io/file_hooks.hpp"

namespace resilient::io {
namespace {

uint64_t page_size() {
  static const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

CachedPages::~CachedPages() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

CachedPages::CachedPages(CachedPages&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), size_(std::exchange(other.size_, 0)) {}

CachedPages& CachedPages::operator=(CachedPages&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) ::munmap(base_, size_);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Result<CachedPages> CachedPages::map(const File& file) {
  RESILIENT_ASSIGN_OR_RETURN(uint64_t size, file.size());
  CachedPages out;
  if (size == 0) return out;
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, file.fd(), 0);
  if (p == MAP_FAILED) return Status::from_errno(errno, "mmap (page cache probe)", file.path());
  out.base_ = p;
  out.size_ = size;
  return out;
}

bool CachedPages::resident(uint64_t offset, uint64_t len) const {
  if (base_ == nullptr || len == 0 || offset >= size_ || len > size_ - offset) return false;
  const uint64_t page = page_size();
  const uint64_t first = offset / page * page;
  const uint64_t end = offset + len;
  std::vector<unsigned char> in((end - first + page - 1) / page);
  if (::mincore(static_cast<std::byte*>(base_) + first, end - first, in.data()) != 0) return false;
  for (unsigned char v : in) {
    if ((v & 1) == 0) return false;
  }
  return true;
}

Result<uint64_t> read_cached(const File& file, void* buf, uint64_t n, uint64_t offset) {
  if (file.direct()) {
    return Status(StatusCode::kInvalidArgument, "read_cached needs a buffered file")
        .with_path(file.path());
  }
  uint64_t done = 0;
  while (done < n) {
    ssize_t got = sys::pread_nowait(file.fd(), static_cast<std::byte*>(buf) + done, n - done,
                                    static_cast<off_t>(offset + done));
    if (got > 0) {
      done += static_cast<uint64_t>(got);
      continue;
    }
    if (got == 0 || errno == EAGAIN) break;  // the end of the file, or a page not cached
    if (errno == EINTR) continue;
    if (errno == EOPNOTSUPP) {
      return Status(StatusCode::kUnavailable, "preadv2 RWF_NOWAIT not supported here")
          .with_errno(EOPNOTSUPP)
          .with_path(file.path());
    }
    return Status::from_errno(errno, "preadv2 (page cache)", file.path())
        .with_offset(offset + done);
  }
  return done;
}

}  // namespace resilient::io
