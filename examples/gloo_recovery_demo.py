"""Kill one rank of a gloo job and time the survivors' rebuild (CPU; CI and benchmarks).

``python examples/gloo_recovery_demo.py --world 4 --kill-rank 1`` starts ``world`` processes that
all-reduce in a loop, SIGKILLs one, tells the survivors which rank died (standing in for the
detector), and prints, as JSON, the time from the kill to the survivors' first successful
collective on the rebuilt group, split into phases:

* ``detect_s``: kill -> the survivor stops using the failed group (collective error or verdict);
* ``abort_s``: abort + destroy of the failed group;
* ``rebuild_s``: the new group of generation 1 (3 ranks) under the ``gen1/`` store prefix;
* ``first_collective_s``: the verifying all_reduce;
* ``total_s``: kill -> first collective done (the slowest survivor);
* ``ddp_s``: re-wrapping a small DDP model and one training step (after the total).

The store is hosted by this (parent) process, as a launcher would, so any rank may die.
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

_HOST = "127.0.0.1"


def _watch_verdict(port: int, verdict: threading.Event, out: dict[str, Any]) -> None:
    """Stands in for the detector: sets ``verdict`` when the parent names the dead rank."""
    import torch.distributed as dist

    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=60))
    try:
        store.wait(["dead"], timedelta(seconds=60))
    except RuntimeError:
        return
    out["t_verdict"] = time.monotonic()
    verdict.set()


def _worker(rank: int, world: int, port: int, results: Any, group_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401  (import cost off the clock)

    from resilient.comm.process_group import generation_store, rebuild_process_group, rewrap_ddp

    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": rank}
    try:
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=generation_store(store, 0), rank=rank,
                                world_size=world, timeout=timedelta(seconds=group_timeout_s))
        x = torch.ones(1)
        dist.all_reduce(x)
        verdict = threading.Event()
        watcher = threading.Thread(target=_watch_verdict, args=(port, verdict, out), daemon=True)
        watcher.start()
        store.add("ready", 1)
        steps, error = 0, ""
        while not verdict.is_set():
            try:
                work = dist.all_reduce(torch.ones(1024), async_op=True)
                # Poll instead of blocking in wait(): a rank stuck in a collective with a
                # healthy peer must notice the verdict without waiting for the group timeout.
                while not work.is_completed() and not verdict.is_set():
                    time.sleep(0.0005)
                if work.is_completed():
                    work.wait()
                    steps += 1
            except RuntimeError as exc:
                error = str(exc).splitlines()[0][:200]
                break
        out["t_detect"] = time.monotonic()
        out["steps"], out["collective_error"] = steps, error
        store.wait(["dead"], timedelta(seconds=30))
        out["t_rebuild_start"] = time.monotonic()
        dead = [int(r) for r in store.get("dead").decode().split(",")]
        res = rebuild_process_group(store, generation=1, excluded=dead, backend="gloo",
                                    timeout=timedelta(seconds=group_timeout_s))
        out["t_first_collective"] = time.monotonic()
        out.update(new_rank=res.rank, new_size=res.world_size, **res.timings.as_dict())
        t0 = time.monotonic()
        torch.manual_seed(res.rank)  # different weights: DDP must broadcast rank 0's
        model = rewrap_ddp(torch.nn.Linear(4, 1), res.group)
        model(torch.randn(8, 4)).sum().backward()
        w = model.module.weight.detach().clone()
        dist.all_reduce(w, group=res.group)
        out["ddp_in_sync"] = bool(torch.allclose(w / res.world_size, model.module.weight))
        out["ddp_s"] = time.monotonic() - t0
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which fails the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    results.put(out)
    results.close()
    results.join_thread()
    # Exit without destructors: the retired gen-0 group's gloo threads may still be waiting for
    # the dead rank until the group timeout.
    os._exit(0)


def run(world: int = 4, kill_rank: int = 1, timeout_s: float = 90.0,
        group_timeout_s: float = 20.0) -> dict[str, Any]:
    """Runs the scenario; returns the phase timings (seconds) and each survivor's report.

    Raises:
        TimeoutError: the workers did not become ready or report within ``timeout_s``.
        RuntimeError: a survivor failed to rebuild.
    """
    import torch.distributed as dist

    if not 0 <= kill_rank < world or world < 2:
        raise ValueError("need world >= 2 and 0 <= kill_rank < world")
    deadline = time.monotonic() + timeout_s
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, results, group_timeout_s),
                         daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        while store.add("ready", 0) < world:
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                raise TimeoutError("workers did not become ready")
            time.sleep(0.05)
        time.sleep(0.2)  # let the survivors get into their collective loop
        t_kill = time.monotonic()
        os.kill(procs[kill_rank].pid, signal.SIGKILL)
        store.set("dead", str(kill_rank))  # the detector's verdict, delivered explicitly
        reports = []
        while len(reports) < world - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"only {len(reports)} of {world - 1} survivors reported")
            try:
                reports.append(results.get(timeout=min(left, 1.0)))
            except queue.Empty:
                continue
        errors = [r for r in reports if "error" in r]
        if errors:
            raise RuntimeError(f"survivors failed: {errors}")
        for p in procs:
            p.join(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    worst = max(reports, key=lambda r: r["t_first_collective"])
    for r in reports:
        r["total_s"] = r["t_first_collective"] - t_kill
        r["to_rebuild_s"] = r["t_rebuild_start"] - t_kill
    return {
        "world": world,
        "kill_rank": kill_rank,
        "method": worst["method"],
        "detect_s": max(r["t_detect"] for r in reports) - t_kill,
        "abort_s": max(r["abort_s"] for r in reports),
        "rebuild_s": max(r["rebuild_s"] for r in reports),
        "first_collective_s": max(r["first_collective_s"] for r in reports),
        "total_s": worst["t_first_collective"] - t_kill,
        "ddp_s": max(r["ddp_s"] for r in reports),
        "survivors": sorted(reports, key=lambda r: r["rank"]),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry: prints the timings as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)
    for _ in range(args.repeat):
        res = run(args.world, args.kill_rank, args.timeout)
        for r in res["survivors"]:
            for k in ("t_detect", "t_first_collective"):
                r.pop(k, None)
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
