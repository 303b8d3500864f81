#!/usr/bin/env python3
"""GPU check of the NCCL recovery path: kill one rank, survivors rebuild, all-reduce again.

Run on a machine with 2-8 GPUs (one process per GPU), from the repository root:

    python scripts/gpu_comm_test.py --nproc 4 --kill-rank 3                 # resilient manager
    python scripts/gpu_comm_test.py --nproc 4 --kill-rank 3 --mode reinit   # abort/revoke + init
    python scripts/gpu_comm_test.py --nproc 4 --kill-rank 3 --api torch     # torch shrink_group

Each worker (``--api manager``): loads the NCCL that torch ships through resilient.comm
(dlopen), creates a non-blocking communicator through CommManager.init_from_store (unique id
exchanged through a TCPStore hosted by this parent), all-reduces and checks the sum. The parent
SIGKILLs ``--kill-rank`` and publishes it under the key ``dead`` (standing in for the
detector); a watcher thread in each survivor calls ``request_abort()`` on the verdict, so a
survivor stuck in a collective with the dead rank stops waiting at once. Survivors then run
``recover()`` (revoke or abort, then shrink or a fresh init under generation 1), all-reduce on
the new communicator and check the sum. ``--api torch`` does the same with a ProcessGroupNCCL
and resilient.comm.process_group.rebuild_process_group (torch.distributed.shrink_group).

Prints one JSON object: NCCL version, plan, and seconds from the kill to the slowest survivor's
first verified all-reduce, split into detect (kill -> stopped waiting), teardown, rebuild and
first collective, plus each survivor's numbers. Exit status 0 when every survivor verified.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

HOST = "127.0.0.1"


def _watch(port: int, on_verdict: Any, out: dict[str, Any]) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=300))
    store.wait(["dead"], timedelta(seconds=300))
    out["t_verdict"] = time.monotonic()
    on_verdict()


def _dead(store: Any) -> list[int]:
    store.wait(["dead"], timedelta(seconds=60))
    return [int(r) for r in store.get("dead").decode().split(",")]


def _manager_worker(rank: int, args: argparse.Namespace, port: int, out: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from resilient.comm import CommManager, CommOptions, TorchStoreAdapter, load_nccl

    torch.cuda.set_device(rank % torch.cuda.device_count())
    tstore = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=300))
    store = TorchStoreAdapter(tstore)
    lib = load_nccl()
    opts = CommOptions.from_env()
    opts.rebuild_mode = args.mode
    opts.collective_timeout_s = args.collective_timeout
    mgr = CommManager(lib, opts)
    out.update(nccl=lib.version_string, nccl_origin=lib.origin)
    stream = torch.cuda.current_stream()

    def all_reduce_checked(value: float, expect: float, timeout: float) -> None:
        x = torch.full((args.count,), value, device="cuda", dtype=torch.float32)
        mgr.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), "float32", "sum",
                       stream.cuda_stream)
        ev = torch.cuda.Event()
        ev.record(stream)
        mgr.wait(ev.query, timeout)
        got = float(x[0].item())
        if got != expect:
            raise RuntimeError(f"all_reduce gave {got}, expected {expect}")

    t0 = time.monotonic()
    mgr.init_from_store(store, 0, args.nproc, rank)
    out["init_s"] = time.monotonic() - t0
    full = sum(r + 1 for r in range(args.nproc))
    t0 = time.monotonic()
    all_reduce_checked(rank + 1, full, 60)
    out["first_all_reduce_s"] = time.monotonic() - t0
    threading.Thread(target=_watch, args=(port, mgr.request_abort, out), daemon=True).start()
    tstore.add("ready", 1)
    steps = 0
    try:
        while True:
            all_reduce_checked(rank + 1, full, args.collective_timeout)
            steps += 1
    except Exception as exc:  # Cancelled (verdict), NCCL error or timeout: the failure
        out["t_detect"] = time.monotonic()
        out["failure"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    out["steps"] = steps
    dead = _dead(tstore)
    out["plan"] = list(mgr.plan(False))
    report = mgr.recover(1, dead, 0, store)
    out.update(teardown=report["teardown"], rebuild=report["rebuild"],
               teardown_s=report["teardown_s"], rebuild_s=report["rebuild_s"],
               fell_back_to_abort=report["fell_back_to_abort"], new_rank=mgr.rank,
               new_size=mgr.size)
    t0 = time.monotonic()
    survivors_sum = sum(r + 1 for r in range(args.nproc) if r not in dead)
    all_reduce_checked(rank + 1, survivors_sum, 60)
    out["t_first_collective"] = time.monotonic()
    out["first_collective_s"] = out["t_first_collective"] - t0
    out["verified"] = True


def _torch_worker(rank: int, args: argparse.Namespace, port: int, out: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from resilient.comm.process_group import generation_store, rebuild_process_group

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    tstore = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=300))
    t0 = time.monotonic()
    dist.init_process_group("nccl", store=generation_store(tstore, 0), rank=rank,
                            world_size=args.nproc, device_id=dev,
                            timeout=timedelta(seconds=args.collective_timeout))
    x = torch.ones(args.count, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    out["init_s"] = time.monotonic() - t0
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    verdict = threading.Event()
    threading.Thread(target=_watch, args=(port, verdict.set, out), daemon=True).start()
    tstore.add("ready", 1)
    steps = 0
    try:
        while not verdict.is_set():
            work = dist.all_reduce(torch.ones(args.count, device=dev), async_op=True)
            while not work.is_completed() and not verdict.is_set():
                time.sleep(0.0002)
            if work.is_completed():
                work.wait()
                steps += 1
    except Exception as exc:
        out["failure"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    out["t_detect"] = time.monotonic()
    out["steps"] = steps
    dead = _dead(tstore)
    res = rebuild_process_group(tstore, generation=1, excluded=dead, backend="nccl",
                                device_id=dev, prefer_shrink=args.mode != "reinit",
                                timeout=timedelta(seconds=60))
    out["t_first_collective"] = time.monotonic()
    out.update(rebuild=res.timings.method, teardown_s=res.timings.abort_s,
               rebuild_s=res.timings.rebuild_s,
               first_collective_s=res.timings.first_collective_s, new_rank=res.rank,
               new_size=res.world_size, verified=True)


def _worker(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    out: dict[str, Any] = {"rank": rank}
    try:
        import torch

        if torch.cuda.device_count() == 0:
            raise RuntimeError("no CUDA device visible")
        fn = _manager_worker if args.api == "manager" else _torch_worker
        fn(rank, args, port, out)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    results.put(out)
    results.close()
    results.join_thread()
    os._exit(0)  # never wait in destructors for the dead rank


def main() -> int:
    ap = argparse.ArgumentParser(description="NCCL kill/rebuild timing on GPUs")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--kill-rank", type=int, default=-1, help="default: the last rank")
    ap.add_argument("--api", choices=["manager", "torch"], default="manager")
    ap.add_argument("--mode", choices=["auto", "shrink", "reinit"], default="auto")
    ap.add_argument("--count", type=int, default=1 << 20, help="float32 elements per all-reduce")
    ap.add_argument("--collective-timeout", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=240.0, help="whole run")
    args = ap.parse_args()
    if args.kill_rank < 0:
        args.kill_rank = args.nproc - 1

    import torch.distributed as dist

    deadline = time.monotonic() + args.timeout
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=args.timeout))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, store.port, results), daemon=True)
             for r in range(args.nproc)]
    reports: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"nproc": args.nproc, "kill_rank": args.kill_rank,
                               "api": args.api, "mode": args.mode, "count": args.count}
    try:
        for p in procs:
            p.start()
        while store.add("ready", 0) < args.nproc:
            if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
                while not results.empty():
                    reports.append(results.get())
                raise TimeoutError(f"workers not ready: {reports}")
            time.sleep(0.05)
        time.sleep(0.5)
        t_kill = time.monotonic()
        os.kill(procs[args.kill_rank].pid, signal.SIGKILL)
        store.set("dead", str(args.kill_rank))
        while len(reports) < args.nproc - 1 and time.monotonic() < deadline:
            try:
                reports.append(results.get(timeout=1.0))
            except queue.Empty:
                pass
    except Exception as exc:
        summary["error"] = f"{type(exc).__name__}: {exc}"
        t_kill = float("nan")
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
    ok = [r for r in reports if r.get("verified")]
    if ok:
        worst = max(ok, key=lambda r: r["t_first_collective"])
        summary.update(
            nccl=ok[0].get("nccl"), plan=ok[0].get("plan"), rebuild=ok[0].get("rebuild"),
            detect_s=max(r["t_detect"] - t_kill for r in ok),
            teardown_s=max(r["teardown_s"] for r in ok),
            rebuild_s=max(r["rebuild_s"] for r in ok),
            first_collective_s=max(r["first_collective_s"] for r in ok),
            total_s=worst["t_first_collective"] - t_kill,
            init_s=max(r.get("init_s", 0.0) for r in ok))
    for r in reports:
        for k in ("t_detect", "t_first_collective", "t_verdict"):
            if k in r:
                r[k + "_rel"] = r.pop(k) - t_kill
    summary["survivors"] = sorted(reports, key=lambda r: r["rank"])
    summary["passed"] = len(ok) == args.nproc - 1
    print(json.dumps(summary, indent=1))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
