"""One function per benchmarked method. Each saves the same state, waits until it is durable,
then restores it with the page cache dropped (cold), then again with the checkpoint's files in
the page cache (warm: a restart on the same host), and returns a Row.

Definitions (seconds from the save call):
  return_s   how long the save call blocked
  stall_s    until the caller may modify the saved tensors again (async methods: staging done)
  durable_s  until the checkpoint is on storage (fsynced) and committed
  write_gbps bytes / (durable_s - stall_s): storage throughput once the state is staged
             (for blocking methods stall_s == durable_s, so bytes / durable_s)
  restore_gbps bytes / time to read the checkpoint back into memory from storage (cold cache)
  warm_gbps  the same with the checkpoint's files in the page cache
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import statistics
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from resilient import _C


@dataclass
class Row:
    method: str
    return_s: float | None = None
    stall_s: float | None = None
    durable_s: float | None = None
    write_gbps: float | None = None
    restore_gbps: float | None = None
    warm_gbps: float | None = None
    ok: bool = True
    skipped: str | None = None  # why the method did not run (a known failure of this torch)
    error: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FIELDS = ("return_s", "stall_s", "durable_s", "write_gbps", "restore_gbps", "warm_gbps")


def median_row(rows: list[Row]) -> Row:
    """Field-wise median of repeated measurements (the notes of the last one); notes["all"] keeps
    every repeat's value of each field, in order."""
    out = Row(rows[-1].method, notes=dict(rows[-1].notes))
    every: dict[str, list[float]] = {}
    for f in FIELDS:
        vals = [getattr(r, f) for r in rows if getattr(r, f) is not None]
        setattr(out, f, statistics.median(vals) if vals else None)
        if vals:
            every[f] = [round(v, 4) for v in vals]
    out.notes["repeats"] = len(rows)
    out.notes["all"] = every
    return out


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


def warm_cache(path: Path) -> None:
    """Reads `path`'s files through the page cache (untimed), as a restart on the same host
    finds them after anything read them buffered."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """Silences DCP's "torch.distributed is disabled ... assuming the intent is to save in a single
    process" (the single-process rows save without a process group on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def drop_cache(path: Path) -> str:
    """Evicts `path`'s files from the page cache; returns how ("drop_caches" or "fadvise")."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    ok = all(_C.drop_file_cache(str(p)) for p in files)
    return "fadvise" if ok else "none (page cache may serve reads)"


def _blocking_row(name: str, nbytes: int, durable: float, restore: float, warm: float,
                  how: str) -> Row:
    """A row for a method whose save blocks until durable (stall == return == durable)."""
    return Row(
        name,
        return_s=durable,
        stall_s=durable,
        durable_s=durable,
        write_gbps=_gbps(nbytes, durable),
        restore_gbps=_gbps(nbytes, restore),
        warm_gbps=_gbps(nbytes, warm),
        notes={"cache": how},
    )


def _timed(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> tuple[float, Any]:
    if before is not None:
        before()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def memcpy_row(state: dict[str, torch.Tensor], nbytes: int, repeat: int,
               before: Callable[[], Any] | None = None) -> Row:
    """One single-threaded memcpy of the same bytes into a pre-touched buffer: the stall floor
    the CPU goal is measured against. `before` runs ahead of each timed copy (a barrier, so
    that every rank of a multi-process bench copies at once, as they save at once)."""
    if next(iter(state.values())).device.type != "cpu":
        return Row("memcpy", ok=False, error="host memcpy row needs CPU tensors")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)
    base = buf.data_ptr()

    def copy() -> None:
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            ctypes.memmove(base + off, t.data_ptr(), n)
            off += n

    copy()  # warm
    rows = [
        Row("memcpy", return_s=s, stall_s=s, notes={"gbps": _gbps(nbytes, s)})
        for s, _ in (_timed(copy, before) for _ in range(repeat))
    ]
    out = median_row(rows)
    # The same copy into memory never touched before: what the first save of a process pays for
    # its buffers' pages on this machine (the kernel zeroes each page at its first write).
    fresh = []
    for _ in range(repeat):
        del buf
        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        base = buf.data_ptr()
        copy()
        fresh.append(time.perf_counter() - t0)
    out.notes["fresh_s"] = statistics.median(fresh)
    return out


def d2h_row(state: dict[str, torch.Tensor], nbytes: int, repeat: int,
            before: Callable[[], Any] | None = None) -> Row:
    """Pinned device-to-host copy of the same bytes: the floor for any blocking GPU snapshot
    (`before`: as for memcpy_row)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy() -> None:
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            host[off : off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            off += n
        torch.cuda.synchronize()

    copy()
    rows = [
        Row("d2h_limit", return_s=s, stall_s=s, notes={"gbps": _gbps(nbytes, s)})
        for s, _ in (_timed(copy, before) for _ in range(repeat))
    ]
    return median_row(rows)


def raw_row(nbytes: int, root: Path, request_bytes: int, queue_depth: int, repeat: int) -> Row:
    """Plain io_uring O_DIRECT writes and reads of the same bytes: the storage limit."""
    path = root / "raw.bin"
    rows = []
    for _ in range(repeat):
        w = _C.raw_write(str(path), nbytes, request_bytes=request_bytes, queue_depth=queue_depth)
        how = drop_cache(path)
        r = _C.raw_read(str(path), request_bytes=request_bytes, queue_depth=queue_depth)
        path.unlink()
        rows.append(
            Row(
                "raw",
                durable_s=w["seconds"],
                write_gbps=_gbps(nbytes, w["seconds"]),
                restore_gbps=_gbps(nbytes, r["seconds"]),
                notes={"engine": w["engine"], "direct": w["direct"], "cache": how},
            )
        )
    return median_row(rows)


def raw_pair(nbytes: int, root: Path, request_bytes: int, queue_depth: int) -> tuple[float, float]:
    """One raw O_DIRECT write and cold read of `nbytes` (GB/s each), right beside a measured save
    and restore, so their ratios compare the two at the same moment of the disk."""
    path = root / "raw-paired.bin"
    w = _C.raw_write(str(path), nbytes, request_bytes=request_bytes, queue_depth=queue_depth)
    drop_cache(path)
    r = _C.raw_read(str(path), request_bytes=request_bytes, queue_depth=queue_depth)
    path.unlink()
    return nbytes / w["seconds"] / 1e9, nbytes / r["seconds"] / 1e9


def resilient_row(
    state,
    nbytes,
    root: Path,
    device: str,
    options: dict[str, Any],
    repeat: int,
    mode: str = "blocking",
    paired: Callable[[], tuple[float, float]] | None = None,
) -> Row:
    """resilient's Checkpointer. In "overlap" mode the stall is the time until wait_snapshot()
    returns when called at once (the device-to-host copies are done); a training loop would
    overlap it with its next forward and backward. The first save of the run (its host buffers
    are new) is reported in notes["first_stall_s"]; with `paired`, each repeat is followed by a
    raw write and read whose speeds its write and restore are divided by (notes["x_raw_*"])."""
    from resilient.checkpoint import Checkpointer

    name = "resilient" if mode == "blocking" else f"resilient_{mode}"
    rows = []
    x_write, x_restore = [], []
    with Checkpointer(root / "ckpt", keep=1, create=True, **options) as ckpt:
        _sync_device(device)
        t0 = time.perf_counter()
        h = ckpt.save(0, state, mode=mode)
        h.wait_snapshot()
        first_stall = time.perf_counter() - t0
        h.wait()
        for step in range(1, repeat + 1):
            ckpt.wait_cleanup()  # retention of the previous step (its deletion too) is done
            _sync_device(device)
            t0 = time.perf_counter()
            h = ckpt.save(step, state, mode=mode)
            ret = time.perf_counter() - t0
            h.wait_snapshot()
            stall = time.perf_counter() - t0
            h.wait()
            st = h.stats()
            durable = st["durable_s"]
            how = drop_cache(root)
            _sync_device(device)
            restore, _ = _timed(lambda s=step: (ckpt.load(state, step=s), _sync_device(device)))
            warm_cache(root / "ckpt")
            warm, _ = _timed(lambda s=step: (ckpt.load(state, step=s), _sync_device(device)))
            row = Row(
                name,
                return_s=ret,
                stall_s=stall,
                durable_s=durable,
                write_gbps=_gbps(nbytes, durable - stall),
                restore_gbps=_gbps(nbytes, restore),
                warm_gbps=_gbps(nbytes, warm),
                notes={
                    "io": ckpt.io_backend,
                    "cache": how,
                    "pinned": ckpt.pool_pinned,
                    "native_issue_s": st["issue_s"],
                    "python_s": ret - st["snapshot_s"],
                    "first_stall_s": first_stall,
                },
            )
            rows.append(row)
            if paired is not None:
                raw_w, raw_r = paired()
                if row.write_gbps:
                    x_write.append(row.write_gbps / raw_w)
                x_restore.append(row.restore_gbps / raw_r)
    out = median_row(rows)
    if x_restore:
        out.notes["x_raw_write"] = statistics.median(x_write) if x_write else None
        out.notes["x_raw_restore"] = statistics.median(x_restore)
        out.notes["x_raw_write_all"] = [round(x, 3) for x in x_write]
        out.notes["x_raw_restore_all"] = [round(x, 3) for x in x_restore]
    return out


def torch_save_row(state, nbytes, root: Path, device: str, repeat: int) -> Row:
    path = root / "model.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load() -> None:
        torch.load(path, map_location=device, weights_only=True)

    save()  # warm-up
    rows = []
    for _ in range(repeat):
        durable, _ = _timed(save)
        how = drop_cache(path)
        restore, _ = _timed(load)
        warm, _ = _timed(load, lambda: warm_cache(path))
        rows.append(_blocking_row("torch.save", nbytes, durable, restore, warm, how))
    return median_row(rows)


def dcp_row(state, nbytes, root: Path, device: str, repeat: int) -> Row:
    import torch.distributed.checkpoint as dcp

    def save(i: int) -> Path:
        d = root / f"dcp-{i}"
        dcp.save(state, checkpoint_id=str(d), no_dist=True)
        return d

    def load(d: Path) -> None:
        dcp.load(state, checkpoint_id=str(d), no_dist=True)
        _sync_device(device)

    with quiet_dcp():
        shutil.rmtree(save(0))
        rows = []
        for i in range(1, repeat + 1):
            durable, d = _timed(lambda i=i: save(i))
            how = drop_cache(d)
            restore, _ = _timed(lambda d=d: load(d))
            warm, _ = _timed(lambda d=d: load(d), lambda d=d: warm_cache(d))
            shutil.rmtree(d)
            rows.append(_blocking_row("dcp", nbytes, durable, restore, warm, how))
    return median_row(rows)


def dcp_stager(device: str, notes: dict[str, Any]) -> Any:
    """torch's DefaultStager for dcp.async_save (pinned buffers on CUDA; host memory cannot be
    pinned without CUDA), or None where this torch has none; says which in notes["stager"]."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        notes["stager"] = "none in this torch"
        return None
    cuda = device == "cuda"
    notes["stager"] = f"DefaultStager(pinned={cuda}, async staging)"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
    )


def dcp_async_row(state, nbytes, root: Path, device: str, repeat: int, reuse_stager: bool) -> Row:
    """dcp.async_save with the installed torch's stager. With reuse_stager (the intended use,
    whose pinned buffers are reused), one stager serves every save; otherwise each save gets a
    fresh stager and pays its allocation."""
    import torch.distributed.checkpoint as dcp

    name = "dcp_async" if reuse_stager else "dcp_async_fresh"
    notes: dict[str, Any] = {}
    shared = dcp_stager(device, notes) if reuse_stager else None

    def save(i: int) -> tuple[Row, Path]:
        stager = shared if reuse_stager else dcp_stager(device, notes)
        d = root / f"dcp-async-{i}"
        try:
            t0 = time.perf_counter()
            resp = dcp.async_save(state, checkpoint_id=str(d), no_dist=True, async_stager=stager)
            ret = time.perf_counter() - t0
            if hasattr(resp, "staging_completion"):
                resp.staging_completion.result()
                stall = time.perf_counter() - t0
                resp.upload_completion.result()
            else:
                stall = ret
                resp.result()
            durable = time.perf_counter() - t0
        finally:
            if stager is not None and not reuse_stager and hasattr(stager, "close"):
                stager.close()
        return Row(
            name,
            return_s=ret,
            stall_s=stall,
            durable_s=durable,
            write_gbps=_gbps(nbytes, durable - stall),
            notes=notes,
        ), d

    ctx = quiet_dcp()
    ctx.__enter__()
    try:
        shutil.rmtree(save(0)[1])  # warm-up
        rows = []
        for i in range(1, repeat + 1):
            try:
                row, d = save(i)
            except KeyError as e:  # the second save through the one stager
                if not reuse_stager:
                    raise
                raise RuntimeError(
                    "this torch's DefaultStager cannot serve a second async_save (its _stage "
                    "closes it: pytorch/pytorch#183413, torch 2.11); dcp_async_fresh is the "
                    "row with a new stager per save") from e
            how = drop_cache(d)

            def load(d: Path = d) -> None:
                dcp.load(state, checkpoint_id=str(d), no_dist=True)
                _sync_device(device)

            restore, _ = _timed(load)
            warm, _ = _timed(load, lambda d=d: warm_cache(d))
            shutil.rmtree(d)
            row.restore_gbps = _gbps(nbytes, restore)
            row.warm_gbps = _gbps(nbytes, warm)
            row.notes = {**notes, "cache": how}
            rows.append(row)
    finally:
        ctx.__exit__(None, None, None)
        if shared is not None and hasattr(shared, "close"):
            shared.close()
    return median_row(rows)


# Methods that fail on a torch version for a reason of torch's own: the default run skips them
# with the reason (a FAILED row would read as a failure of the benchmark); asked for by name
# (--methods), they run.
KNOWN_FAILURES = {
    ("dcp_async", "2.11"): "torch 2.11's DefaultStager fails on its second async_save "
    "(KeyError in _stage: pytorch/pytorch#183413); dcp_async_fresh is the same with a new "
    "stager per save",
}


def known_failure(method: str, torch_version: str) -> str | None:
    """Why `method` is known to fail on this torch, or None."""
    major_minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    return KNOWN_FAILURES.get((method, major_minor))


def run_guarded(name: str, fn: Callable[[], Row]) -> Row:
    """Runs one method; a method that fails is reported as failed with its error, not dropped."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a failing baseline is a result
        return Row(
            name,
            ok=False,
            error=f"{type(e).__name__}: {e}",
            notes={"traceback": traceback.format_exc(limit=3)},
        )
