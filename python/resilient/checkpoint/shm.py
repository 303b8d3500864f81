"""One host's shared read buffer for a restore: a file under /dev/shm that the ranks of a host
read their shares of the checkpoint into and copy their pieces out of (Reader.run_shared).

Named ``resilient-restore-<pid>-<tag>`` (the creating rank's pid and a tag the ranks agree on),
created with O_EXCL and sized, not filled (only the header is reserved): every page is reserved
before it is written, so a full /dev/shm is an error, not a SIGBUS. The native engine reserves
the pages of a rank's run chunk by chunk as it writes them (read targets' "populate",
`can_populate`); a rank reserves the pages it receives from other hosts itself (`reserve`), as
it does all of them on kernels before 5.14. The header's progress words (`Progress`) say which
pieces are in place, and the other ranks of the host copy each piece out while the rest is read.
Unlinked by its creator once every rank is done reading (the mappings keep the memory until
dropped, on a thread: `release_later`). Files left by a creator that died are removed by the
next creation on the host."""

from __future__ import annotations

import errno
import os
import re
import threading

import torch

from resilient import _C

DIR = "/dev/shm"
_NAME = re.compile(r"resilient-restore-(\d+)-[0-9a-z.-]+")


def path_for(tag: str, directory: str = DIR) -> str:
    return os.path.join(directory, f"resilient-restore-{os.getpid()}-{tag}")


def sweep(directory: str = DIR) -> list[str]:
    """Removes the buffers whose creator no longer runs; returns their paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


PROGRESS = 1024  # the header: the token, then from here the readers' words, then the pieces'
QUEUE = PROGRESS - 16  # the two words of the readers' shared queue (the engine's `queue`)


def header_bytes(readers: int, pieces: int = 0) -> int:
    """Bytes before the data (page aligned, for O_DIRECT reads into it): the token and one
    int64 word per reader and per piece (Progress)."""
    return max(4096, -(-(PROGRESS + 8 * (readers + pieces)) // 4096) * 4096)


def create(path: str, size: int, token: str, header: int = 4096) -> None:
    """Creates the buffer, `size` bytes long, with `token` at its start and its first `header`
    bytes reserved (the rest is backed by `reserve`). OSError (EEXIST, ENOSPC...) leaves no
    file behind."""
    if len(token.encode()) >= QUEUE:
        raise OSError(errno.ENAMETOOLONG, f"buffer token too long: {token!r}")
    sweep(os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, min(header, size))  # the progress words: every rank's
        os.pwrite(fd, token.encode(), 0)
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)


def check(path: str, size: int, token: str) -> str | None:
    """None when `path` is the creator's buffer (its size and token), else why not."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return f"{path}: {e} (the ranks of this host do not share {os.path.dirname(path)}?)"
    try:
        if os.fstat(fd).st_size != size or os.pread(fd, len(token), 0) != token.encode():
            return f"{path} is not the buffer its creator made (another /dev/shm?)"
    finally:
        os.close(fd)
    return None


def open_mapped(path: str, size: int) -> torch.Tensor:
    """The existing buffer mapped shared, as a uint8 tensor of `size` bytes (header included)."""
    os.close(os.open(path, os.O_RDONLY))  # exists (from_file would create it)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def reserve(path: str, mapping: torch.Tensor, offset: int, nbytes: int) -> None:
    """Backs bytes [offset, offset + nbytes) of the buffer (`mapping`: all of it, mapped) with
    memory before they are written: OSError ENOSPC when /dev/shm has no room (writing them
    would raise SIGBUS). On kernels before 5.14 (no MADV_POPULATE_WRITE), posix_fallocate,
    which the readers of a host then take in turn."""
    err = _C.populate_write(mapping.data_ptr() + offset, nbytes)  # (EINTR retried there)
    if err == errno.EINVAL:
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, offset, nbytes)
            return
        except OSError as e:
            err = e.errno
        finally:
            os.close(fd)
    if err in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):  # no page to be had
        raise OSError(errno.ENOSPC, f"{os.path.dirname(path)} has no room for {nbytes} bytes of "
                      f"the restore's shared buffer ({os.strerror(err)})", path)
    if err:
        raise OSError(err, f"reserving the restore's shared buffer: {os.strerror(err)}", path)


#: The last thread started by release_later (tests join it).
releasing: threading.Thread | None = None


def release_later(held: list) -> None:
    """Drops the references in `held` (the last ones to a mapped buffer, so unmapping it) on
    a thread of its own. Not a daemon: an interpreter that exits meanwhile waits for it (a
    daemon thread ended at exit inside torch's unmap aborts the process)."""
    global releasing
    wait_released()
    releasing = threading.Thread(target=held.clear, name="resilient-shm-release")
    releasing.start()


def wait_released() -> None:
    """Waits until the buffer release_later is unmapping is gone (its pages are back)."""
    if releasing is not None:
        releasing.join()


def can_populate(mapping: torch.Tensor) -> bool:
    """Whether pages of `mapping` can be reserved as they are written (MADV_POPULATE_WRITE,
    Linux 5.14 on): asked of its first page, which `create` reserved."""
    return _C.populate_write(mapping.data_ptr(), 1) == 0


class Progress:
    """The progress words in a mapped buffer's header: reader i publishes FAILED when its reads
    fail (release); each piece's word is made odd by the engine once that piece is verified
    and in place (native read targets' "done", which count the piece's chunks in the word
    first). The others observe them (acquire). `queue`: the address of the two words through
    which the host's readers claim the reads (the engine's queue). A new buffer holds zeros:
    nothing read, nothing failed, nothing claimed."""

    FAILED = -1

    def __init__(self, mapping: torch.Tensor, readers: int, pieces: int = 0):
        assert mapping.numel() >= PROGRESS + 8 * (readers + pieces)
        self._mapping = mapping  # keeps the words mapped
        self._base = mapping.data_ptr() + PROGRESS
        self._pieces = self._base + 8 * readers
        self.queue = mapping.data_ptr() + QUEUE

    def publish(self, reader: int, state: int) -> None:
        _C.publish_i64(self._base + 8 * reader, state)

    def get(self, reader: int) -> int:
        return _C.observe_i64(self._base + 8 * reader)

    def piece_word(self, piece: int) -> int:
        """The address of piece `piece`'s word (for the engine to set)."""
        return self._pieces + 8 * piece

    def pieces_done(self, first: int, count: int) -> bytes:
        """One byte per piece first..first+count-1: 1 once it is in place (its word odd), else
        0."""
        return _C.observe_many(self._pieces + 8 * first, count)


#: A closed queue's next group (the engine's kClosed): no reader claims another.
CLOSED = 1 << 62


def close_queue(queue: int) -> None:
    """Closes the readers' queue at `queue` (Progress.queue): they stop claiming groups."""
    _C.publish_i64(queue, CLOSED)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
