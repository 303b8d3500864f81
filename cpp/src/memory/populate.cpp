#include "resilient/memory/populate.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#ifndef MADV_POPULATE_WRITE  // older C library headers; the kernel answers EINVAL before 5.14
#define MADV_POPULATE_WRITE 23
#endif

namespace resilient::memory {

int populate_write(void* addr, uint64_t nbytes) {
  if (nbytes == 0) return 0;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(addr) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(addr) + nbytes + page - 1) / page * page;
  while (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

}  // namespace resilient::memory
