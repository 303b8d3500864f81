"""The reads of a shared restore on one host (Reader.run_shared, CPU path): each rank of the
host reads its run of the host's /dev/shm buffer (checkpoint.shm) in one engine call on a thread
of its own, and the engine marks each piece done, in a word of the buffer's header, as soon as
it is verified and in place; meanwhile every rank of the host copies the pieces it needs out of
the buffer as they are marked. A restore then takes about the slowest reader's time, not the
reads followed by the copies (benchmarks/RESULTS.md, issue 17).

A reader that fails publishes FAILED in its own word: the others stop copying and every rank
learns the error in the gather after the reads. A reader that stops (frozen, killed) is a piece
that does not arrive: the wait for it is a polled one (Ranks.wait), ended by the checkpointer's
timeout or by abort()."""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from resilient.checkpoint import shm


def layout(names: list[str], entries: dict[str, dict], readers: int,
            align: int = 4096) -> tuple[dict[str, int], int, dict[str, int]]:
    """Places `names` (in file order) in one buffer, offsets aligned for O_DIRECT, and splits
    them over `readers` in contiguous runs of about equal bytes (a piece goes to the reader
    whose share holds its middle byte): each reader reads one sequential stretch of the files,
    which on a disk measured 10-25x faster than interleaved pieces (benchmarks/RESULTS.md).
    Returns (offset per name, buffer size, reader per name)."""
    where, size = {}, 0
    for n in names:
        where[n] = size
        size += (entries[n]["nbytes"] + align - 1) // align * align
    total = sum(entries[n]["nbytes"] for n in names)
    share, before = {}, 0
    for n in names:
        nbytes = entries[n]["nbytes"]
        share[n] = min(readers - 1, (2 * before + nbytes) * readers // (2 * total)) if total else 0
        before += nbytes
    return where, size, share


def spans(part: list[str], where: dict[str, int], entries: dict[str, dict],
          align: int = 4096) -> list[tuple[int, int]]:
    """The byte ranges [lo, hi) of `part`'s pieces in the buffer, in order, pieces that follow
    one another (placed `align`-aligned, as `layout` does) merged into one range."""
    out: list[tuple[int, int]] = []
    for n in sorted(part, key=where.__getitem__):
        lo, hi = where[n], where[n] + entries[n]["nbytes"]
        if out and lo <= -(-out[-1][1] // align) * align:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class Arrival:
    """Piece `piece` of the buffer in place, or its reader `reader` failed, as a work object for
    Ranks.wait, which polls is_completed(). wait() polls as well, up to `timeout` seconds
    (TimeoutError), for callers without Ranks (reader.Blocking)."""

    def __init__(self, progress: shm.Progress, reader: int, piece: int, timeout: float):
        self.progress, self.reader, self.piece, self.timeout = progress, reader, piece, timeout

    def is_completed(self) -> bool:
        return (self.progress.piece_done(self.piece)
                or self.progress.get(self.reader) == shm.Progress.FAILED)

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"piece {self.piece} of the host's buffer did not arrive "
                                   f"within {self.timeout:g} s")
            time.sleep(0.001)


class RunReader(threading.Thread):
    """Reads this rank's run of the buffer (`run`: piece names; `index`: each piece's word)
    into the mapped buffer (`mapping`: header and data) in one engine call, after reserving its
    pages and those of `receives` (the [lo, hi) ranges of the buffer this rank receives from
    other hosts); the engine marks each piece done as it lands. On failure publishes FAILED as
    reader `slot`. Then, unless stop() was called, calls `then` (the pieces only this rank
    needs, straight into its targets), which returns the bytes it read. `read(targets)` is the
    engine's verified read. After join(): `error` (None, or what failed, without its
    traceback, which would keep the buffer mapped), `no_room` (the pages could not be
    reserved: every rank should read directly) and `bytes_read`."""

    def __init__(self, read: Callable[[list[dict]], None], then: Callable[[], int], path: str,
                 mapping: torch.Tensor, header: int, where: dict[str, int],
                 entries: dict[str, dict], run: list[str], receives: list[tuple[int, int]],
                 index: dict[str, int], slot: int, progress: shm.Progress | None):
        super().__init__(name="resilient-restore-read", daemon=True)
        self._read, self._then, self._path, self._mapping = read, then, path, mapping
        self._header, self._where, self._entries = header, where, entries
        self._run, self._receives, self._index = run, receives, index
        self._slot, self._progress = slot, progress
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self.no_room = False
        self.bytes_read = 0

    def stop(self) -> None:
        """The load is abandoned: read nothing more after the run in progress."""
        self._stopped.set()

    def run(self) -> None:
        if self._run or self._receives:
            assert self._progress is not None  # they exist only with a buffer
            try:
                self._read_run(self._progress)
            except BaseException as e:  # noqa: BLE001 -- reported after join()
                self.error = e.with_traceback(None)
                self._progress.publish(self._slot, shm.Progress.FAILED)
                return
        if self._stopped.is_set():
            return
        try:
            self.bytes_read += self._then()
        except BaseException as e:  # noqa: BLE001 -- reported after join()
            self.error = e.with_traceback(None)

    def _read_run(self, progress: shm.Progress) -> None:
        try:  # every page this rank writes, before it writes any: no SIGBUS on a full tmpfs
            for lo, hi in spans(self._run, self._where, self._entries) + self._receives:
                shm.reserve(self._path, self._mapping, self._header + lo, hi - lo)
        except OSError:
            self.no_room = True
            raise
        base = self._mapping.data_ptr() + self._header
        targets = [{"name": n, "ptr": base + self._where[n], "nbytes": self._entries[n]["nbytes"],
                    "device": -1, "done": progress.piece_word(self._index[n])}
                   for n in self._run]
        self._read(targets)
        self.bytes_read += sum(t["nbytes"] for t in targets)
