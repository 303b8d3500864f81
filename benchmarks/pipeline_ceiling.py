"""The per-process ceiling of the checkpoint pipeline (issue 17): what one process can save and
restore per second when storage is not the limit, and which stage bounds it.

Stages, each timed alone on the same bytes: a single-threaded memcpy (the snapshot's copy), the
XXH3 checksum, raw io_uring and thread-engine writes and reads of the sink (`--dir`, a tmpfs such
as /dev/shm by default), and the same bytes as 1, 2, 4 and 8 files written by as many threads at
once (a file's writes are serialized by its inode lock in the page cache). Then whole saves and
restores of a CPU state through the Checkpointer, once per engine setting (each in its own
process, its RESILIENT_* variables set), so the rows show which knob moves the ceiling.
Save GB/s counts save() to durable; restore GB/s counts load().

    python benchmarks/pipeline_ceiling.py --dir /dev/shm/ceiling --size 8GiB --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

# (label, settings): the default engine first, then one knob moved at a time.
CONFIGS = [
    ("default", {}),
    ("copy_threads=8", {"RESILIENT_COPY_THREADS": "8"}),
    ("copy_threads=16", {"RESILIENT_COPY_THREADS": "16"}),
    ("queue_depth=32", {"RESILIENT_IO_QUEUE_DEPTH": "32"}),
    ("threads engine x8", {"RESILIENT_IO_URING": "off", "RESILIENT_IO_THREADS": "8"}),
    ("restore_threads=4", {"RESILIENT_RESTORE_THREADS": "4"}),  # the default until 2026-11-25
    ("restore_threads=8", {"RESILIENT_RESTORE_THREADS": "8"}),
    ("restore_threads=16", {"RESILIENT_RESTORE_THREADS": "16"}),
    ("slab 256MiB", {"RESILIENT_POOL_SLAB_BYTES": "256MiB"}),
    ("files_per_rank=4", {"RESILIENT_FILES_PER_RANK": "4"}),
    ("files_per_rank=8", {"RESILIENT_FILES_PER_RANK": "8"}),
    ("files_per_rank=16", {"RESILIENT_FILES_PER_RANK": "16"}),
    ("all of the above", {"RESILIENT_COPY_THREADS": "16", "RESILIENT_IO_QUEUE_DEPTH": "32",
                          "RESILIENT_RESTORE_THREADS": "16", "RESILIENT_FILES_PER_RANK": "8"}),
]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/dev/shm/resilient-ceiling", help="the sink (removed after)")
    p.add_argument("--size", default="4GiB", help="state bytes")
    p.add_argument("--tensors", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="timed saves and loads (median)")
    p.add_argument("--configs", default=None, help="comma-separated labels (default: all)")
    p.add_argument("--json", default=None, help="also write the result to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _gbps(n: int, s: float) -> float:
    return round(n / s / 1e9, 2) if s > 0 else 0.0


def _state(nbytes: int, tensors: int):
    import torch

    g = torch.Generator().manual_seed(0)
    each = nbytes // tensors // 2  # bfloat16 elements
    return {f"t{i}": torch.randn(each, generator=g, dtype=torch.float32).to(torch.bfloat16)
            for i in range(tensors)}


def stages(args: argparse.Namespace, nbytes: int) -> dict:
    """Each stage alone: memcpy (1 thread), XXH3 (1 thread), raw io_uring write/read."""
    import torch

    from resilient import _C

    out: dict = {}
    src = torch.ones(1 << 30, dtype=torch.uint8)
    dst = torch.zeros(1 << 30, dtype=torch.uint8)
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), 1 << 30)
    t = []
    for _ in range(3):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), 1 << 30)
        t.append(time.perf_counter() - t0)
    out["memcpy_1thread_gbps"] = _gbps(1 << 30, min(t))
    data = bytes(1 << 30)
    t = []
    for _ in range(3):
        t0 = time.perf_counter()
        _C.xxh3_hex(data)
        t.append(time.perf_counter() - t0)
    out["xxh3_1thread_gbps"] = _gbps(1 << 30, min(t))
    del data, src, dst
    path = os.path.join(args.dir, "raw.bin")
    for uring, depth in (("auto", 8), ("auto", 32), ("off", 8), ("off", 32)):
        w = _C.raw_write(path, nbytes, queue_depth=depth, uring=uring)
        r = _C.raw_read(path, queue_depth=depth, uring=uring)
        os.unlink(path)
        out[f"raw_{w['engine']}_qd{depth}"] = {"write_gbps": _gbps(nbytes, w["seconds"]),
                                 "read_gbps": _gbps(nbytes, r["seconds"]),
                                 "engine": w["engine"], "direct": w["direct"]}
    for k in (1, 2, 4, 8, 16):  # the same bytes as k files, written (then read) by k threads
        runs = [_parallel_files(args.dir, nbytes, k) for _ in range(2)]
        out[f"raw_{k}_files"] = {d: max(r[d] for r in runs) for d in runs[0]}  # best of 2
    return out


def _parallel_files(where: str, nbytes: int, k: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from resilient import _C

    paths = [os.path.join(where, f"par{i}.bin") for i in range(k)]
    with ThreadPoolExecutor(k) as pool:  # raw_write and raw_read release the GIL
        t0 = time.perf_counter()
        list(pool.map(lambda p: _C.raw_write(p, nbytes // k), paths))
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(pool.map(_C.raw_read, paths))
        r = time.perf_counter() - t0
    for p in paths:
        os.unlink(p)
    return {"write_gbps": _gbps(nbytes, w), "read_gbps": _gbps(nbytes, r)}


def child(args: argparse.Namespace, nbytes: int) -> dict:
    """Saves and loads of one CPU state through the Checkpointer (this process's settings)."""
    from resilient.checkpoint import Checkpointer

    state = _state(nbytes, args.tensors)
    real = sum(t.numel() * t.element_size() for t in state.values())
    root = os.path.join(args.dir, args.child)
    saves, written, snaps, loads = [], [], [], []
    with Checkpointer(root, keep=1, create=True) as ck:
        ck.save(0, state).wait()  # warm: the pool's slabs are allocated once
        ck.load(state, step=0)
        for step in range(1, args.repeat + 1):
            ck.wait_cleanup()
            t0 = time.perf_counter()
            h = ck.save(step, state)
            h.wait()
            saves.append(time.perf_counter() - t0)
            st = h.stats()
            snaps.append(st["snapshot_s"])
            written.append(st["written_s"] - st["snapshot_s"])
            t0 = time.perf_counter()
            ck.load(state, step=step)
            loads.append(time.perf_counter() - t0)
        io = ck.io_backend
    shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    return {"bytes": real, "io": io, "save_s": med(saves), "save_gbps": _gbps(real, med(saves)),
            "snapshot_gbps": _gbps(real, med(snaps)), "write_phase_gbps": _gbps(real, med(written)),
            "restore_s": med(loads), "restore_gbps": _gbps(real, med(loads))}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    from resilient import _C

    nbytes = _C.parse_bytes(args.size)
    os.makedirs(args.dir, exist_ok=True)
    if args.child:
        print(json.dumps(child(args, nbytes)))
        return 0
    wanted = set(args.configs.split(",")) if args.configs else None
    result = {"cores": os.cpu_count(), "size": args.size, "tensors": args.tensors, "dir": args.dir,
              "stages": stages(args, nbytes), "configs": []}
    print(json.dumps(result["stages"]), flush=True)
    try:
        for label, env in CONFIGS:
            if wanted and label not in wanted:
                continue
            cmd = [sys.executable, __file__, "--dir", args.dir, "--size", args.size,
                   "--tensors", str(args.tensors), "--repeat", str(args.repeat),
                   "--child", f"c{len(result['configs'])}"]
            p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                               timeout=1800)
            row = {"config": label, "env": env}
            if p.returncode == 0:
                row.update(json.loads(p.stdout.strip().splitlines()[-1]))
            else:
                row["error"] = p.stderr.strip()[-400:]
            result["configs"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
