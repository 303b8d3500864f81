"""A checkpoint collective that waits for a peer gone silent ends when the detector's verdict
aborts it (Ranks.abort), not after gloo's timeout: 3 gloo processes, rank 2 never gathers;
rank 0 aborts from another thread after 1 s and raises CollectiveError, and rank 1, which did
not abort itself, gives up as soon as it sees rank 0's mark in the store. Before, a survivor
could block in the save's all_gather_object until the group's timeout (the quickstart
replacement test caught one: the detector evicted that rank for hanging 30 s).

Runs in child processes started by this file's __main__ (own session, killed on timeout)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from procs import run_bounded

WORLD = 3
GROUP_TIMEOUT_S = 60  # far above what the test allows: the abort must end the wait
SILENT_S = 30  # the longest rank 2 stays silent (and rank 0 serves the store) for the others


def _wait_for_files(out_dir: str, ranks: list[int]) -> None:
    """Until these ranks wrote their results, or SILENT_S passed (a rank that never ends its
    gather then meets a peer gone away, and its time says so)."""
    deadline = time.monotonic() + SILENT_S
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(out_dir, f"rank{r}.json")) for r in ranks):
        time.sleep(0.05)


def _worker(rank: int, port: int, out_dir: str) -> None:
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from resilient.checkpoint.ranks import Ranks
    from resilient.errors import CollectiveError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    ranks = Ranks(True, None, None, GROUP_TIMEOUT_S, collective_timeout=GROUP_TIMEOUT_S)
    assert ranks.gather(("hello", rank)) == [("hello", r) for r in range(WORLD)]
    assert ranks.broadcast({"from": rank}) == {"from": 0}
    result: dict = {}
    if rank < 2:
        if rank == 0:
            threading.Timer(1.0, ranks.abort, args=("rank 2 failed",)).start()
        t0 = time.monotonic()
        try:
            ranks.gather(("second", rank))
            result["outcome"] = "returned"
        except CollectiveError as e:
            result["outcome"] = f"CollectiveError: {e}"
        result["seconds"] = time.monotonic() - t0
        if rank == 0:  # rank 0 serves the store: rank 1 reads the abort mark from it
            _wait_for_files(out_dir, [1])
    else:  # alive and connected, but silent: the others' gather cannot finish
        _wait_for_files(out_dir, [0, 1])
    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"),
               os.path.join(out_dir, f"rank{rank}.json"))
    os._exit(0)  # rank 2 and the abandoned collective: leave without gloo's teardown


@pytest.mark.timeout(120)
def test_an_abort_ends_a_gather_that_waits_for_a_silent_peer(tmp_path):
    rc, output = run_bounded([sys.executable, __file__, str(tmp_path)], 90, "scenario")
    assert rc == 0, output[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(2))
    assert r0["outcome"] == "CollectiveError: checkpoint collective abandoned: rank 2 failed", r0
    assert 0.9 <= r0["seconds"] < 10, r0
    assert r1["outcome"].startswith("CollectiveError") and "rank 2 failed" in r1["outcome"], r1
    assert r1["seconds"] < 15, r1


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    port = free_port()
    mp.start_processes(_worker, args=(port, sys.argv[1]), nprocs=WORLD,
                       start_method="spawn")
