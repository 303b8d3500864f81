#pragma once
// Backing the pages of a shared mapping before they are written. Writing to a page of a
// MAP_SHARED tmpfs (/dev/shm) mapping that the file system has no room for raises SIGBUS;
// populating it first turns that into an error code.

#include <cstdint>

namespace resilient::memory {

/// Allocates the pages covering [addr, addr + nbytes) for writing (madvise
/// MADV_POPULATE_WRITE; EINTR retried). Returns 0, or the errno: EFAULT or ENOMEM where a page
/// could not be had (a full tmpfs, a mapping that cannot be written), EINVAL on kernels before
/// 5.14, which lack the advice.
int populate_write(void* addr, uint64_t nbytes);

}  // namespace resilient::memory
