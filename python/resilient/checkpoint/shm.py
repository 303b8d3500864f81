"""One host's shared read buffer for a restore: a file under /dev/shm that the ranks of a host
read their shares of the checkpoint into and copy their pieces out of (Reader.run_shared).

Named ``resilient-restore-<pid>-<tag>`` (the creating rank's pid and a tag the ranks agree on),
created with O_EXCL, its space reserved with posix_fallocate (so a full /dev/shm is an error
here, not a SIGBUS later), unlinked by its creator as soon as every rank mapped it (the mapping
keeps the memory until it is dropped). Files left by a creator that died are removed by the
next creation on the host."""

from __future__ import annotations

import os
import re

import torch

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


HEADER = 4096  # the token, then the data (page aligned)


def create(path: str, size: int, token: str) -> None:
    """Creates the buffer with `size` bytes reserved and `token` at its start. OSError (ENOSPC,
    EEXIST...) leaves no file behind."""
    sweep(os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
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
    """The existing buffer mapped shared, as a uint8 tensor of `size` bytes (HEADER included)."""
    if size <= HEADER:
        return torch.empty(size, dtype=torch.uint8)
    os.close(os.open(path, os.O_RDONLY))  # exists (from_file would create it)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
