"""The reads of a shared restore on one host (Reader.run_shared, CPU path): the ranks of the
host read the host's pieces into its /dev/shm buffer (checkpoint.shm), each in one engine call on
a thread of its own, and the engine marks each piece done, in a word of the buffer's header, as
soon as it is verified and in place; meanwhile every rank of the host copies the pieces it needs
out of the buffer as they are marked. The engines take the reads from one queue in the header,
so the ranks finish together however unevenly the storage serves them (before Linux 5.14, each
reads a fixed run). A restore then takes about the reads' time, not the reads followed by the
copies (benchmarks/RESULTS.md, issue 17).

A reader that fails publishes FAILED in its own word: the others stop copying and every rank
learns the error in the gather after the reads. A reader that stops (frozen, killed) is a piece
that does not arrive: the wait for it is a polled one (Ranks.wait), ended by the checkpointer's
timeout or by abort()."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import torch

from resilient.checkpoint import shm
from resilient.errors import ResourceExhaustedError


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


#: In the engine's error for a populate target whose pages could not be had (restore.cpp).
NO_PAGE = "in its shared mapping"


class Arrivals:
    """The pieces of the host's buffer that this rank copies out, taken as they land, in any
    order: the engines finish the pieces of a run roughly in its order, a few groups at a time,
    so each run's next `window` pieces not yet taken are watched. `runs[i]`: the pieces of run
    i (a reader's fixed run, or all of them where the readers share a queue), whose words
    (`index`) follow one another; `wanted`: the pieces this rank takes; `readers`: the host's
    readers, any of which may publish FAILED. A work object for Ranks.wait: is_completed()
    once a piece landed or a reader failed; then take() returns the pieces landed since the
    last take(), and `failed` tells the rest. wait() polls as well, up to `timeout` seconds
    (TimeoutError), for callers without Ranks."""

    def __init__(self, progress: shm.Progress, runs: list[list[str]], index: dict[str, int],
                 wanted: set[str], timeout: float, window: int = 256, readers: int = 0):
        self._progress, self._runs, self.timeout, self._window = progress, runs, timeout, window
        self._readers = readers or len(runs)
        self._first = [index[run[0]] if run else 0 for run in runs]
        for run, first in zip(runs, self._first):
            assert all(index[n] == first + k for k, n in enumerate(run)), "words not in run order"
        self._taken = [bytearray(n not in wanted for n in run) for run in runs]
        self._cursor = [0] * len(runs)
        self._ready: list[str] = []
        self.failed = False
        self._advance()

    def left(self) -> bool:
        """Whether pieces remain to be taken."""
        return bool(self._ready) or any(c < len(r) for c, r in zip(self._cursor, self._runs))

    def take(self) -> list[str]:
        ready, self._ready = self._ready, []
        return ready

    def is_completed(self) -> bool:
        if not self._ready and not self.failed:
            self._scan()
        return bool(self._ready) or self.failed

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no piece of the host's buffer arrived within "
                                   f"{self.timeout:g} s")
            time.sleep(0.001)

    def _scan(self) -> None:
        if any(self._progress.get(r) == shm.Progress.FAILED for r in range(self._readers)):
            self.failed = True
            return
        for i, run in enumerate(self._runs):
            c = self._cursor[i]
            if c >= len(run):
                continue
            hi = min(len(run), c + self._window)
            landed = self._progress.pieces_done(self._first[i] + c, hi - c)
            new = int.from_bytes(landed, "little") & ~int.from_bytes(self._taken[i][c:hi], "little")
            while new:  # one byte per piece: bit 8k is piece c + k
                low = new & -new
                k = c + (low.bit_length() - 1) // 8
                self._taken[i][k] = 1
                self._ready.append(run[k])
                new ^= low
        self._advance()

    def _advance(self) -> None:
        for i, taken in enumerate(self._taken):
            c = self._cursor[i]
            while c < len(taken) and taken[c]:
                c += 1
            self._cursor[i] = c


def copy_workers(local: int) -> int:
    """Threads that copy a rank's pieces out of the host's buffer: its share of the CPUs it may
    run on, which `local` ranks of the host share, at most 4. The copies release the GIL;
    several run at once beside the reads, and the last pieces' copies, after the reads, end
    sooner."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus // max(1, local)))


class RunReader(threading.Thread):
    """Reads pieces of the host's buffer (`mapping`: header and data) in one engine call: this
    rank's fixed run (`run`: piece names; `index`: each piece's word), or, with `queue` (the
    address of the header's queue words), whatever part of `run` (then the host's whole read)
    this engine claims before the host's other readers do. Then it reserves the pages of
    `receives` (the [lo, hi) ranges of the buffer this rank receives from other hosts). The
    engine reserves the pages it writes as it writes them, and marks each piece done as it
    lands (without `populate`, every page of a fixed run is reserved first; a queue needs
    `populate`). On failure publishes FAILED as reader `slot`. Then, unless stop() was called,
    calls `then` (the pieces only this rank needs, straight into its targets), which returns
    the bytes it read. `read(targets, queue)` is the engine's verified read, which returns the
    bytes it read; `populate`: whether the engine reserves the pages as it writes them
    (shm.can_populate). After join(): `error` (None, or what failed, without its traceback,
    which would keep the buffer mapped), `no_room` (the pages could not be reserved: every
    rank should read directly) and `bytes_read`."""

    def __init__(self, read: Callable[[list[dict], int], int], then: Callable[[], int],
                 path: str, mapping: torch.Tensor, header: int, where: dict[str, int],
                 entries: dict[str, dict], run: list[str], receives: list[tuple[int, int]],
                 index: dict[str, int], slot: int, progress: shm.Progress | None,
                 populate: bool, queue: int = 0):
        super().__init__(name="resilient-restore-read", daemon=True)
        assert populate or not queue, "a shared queue needs pages reserved as they are written"
        self._read, self._then, self._path, self._mapping = read, then, path, mapping
        self._header, self._where, self._entries = header, where, entries
        self._run, self._receives, self._index = run, receives, index
        self._slot, self._progress, self._populate = slot, progress, populate
        self._queue = queue
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self.no_room = False
        self.bytes_read = 0
        self.seconds: dict[str, float] = {}  # "reserve", "engine": parts of the run's read

    def stop(self) -> None:
        """The load is abandoned: read nothing more after the run in progress (with a queue,
        it is closed: every reader of the host stops after the groups it is reading)."""
        self._stopped.set()
        if self._queue:
            shm.close_queue(self._queue)

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

    def _reserve(self, ranges: list[tuple[int, int]]) -> None:
        try:
            for lo, hi in ranges:
                shm.reserve(self._path, self._mapping, self._header + lo, hi - lo)
        except OSError:
            self.no_room = True
            raise

    def _read_run(self, progress: shm.Progress) -> None:
        # Every page this rank writes is reserved before it is written: no SIGBUS on a full
        # tmpfs. The engine reserves the pages it writes, chunk by chunk as it writes them,
        # beside the reads; where it cannot (kernels before 5.14), they are reserved first.
        clock = time.perf_counter
        t0 = clock()
        if not self._populate:
            self._reserve(spans(self._run, self._where, self._entries) + self._receives)
        t1 = clock()
        base = self._mapping.data_ptr() + self._header
        targets = [{"name": n, "ptr": base + self._where[n], "nbytes": self._entries[n]["nbytes"],
                    "device": -1, "done": progress.piece_word(self._index[n]),
                    "populate": self._populate} for n in self._run]
        try:
            self.bytes_read += self._read(targets, self._queue) if targets else 0
        except ResourceExhaustedError as e:  # the engine found no page for its run
            self.no_room = self._populate and NO_PAGE in str(e)
            raise
        t2 = clock()
        if self._populate:
            self._reserve(self._receives)  # written by the exchange, after every rank's read
        self.seconds = {"reserve": round(t1 - t0 + clock() - t2, 4), "engine": round(t2 - t1, 4)}
