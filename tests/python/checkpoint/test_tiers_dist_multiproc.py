"""Tiers in a 2-rank gloo job: rank 0 drains; a fresh root is filled from the tier by rank 0
while rank 1 waits longer than the collective timeout; a copy that fails verification on rank 1
is fetched again by rank 0 and the same step loads on both ranks.

The scenario runs in child processes started by this file's __main__ (own session, killed as a
group on timeout)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from procs import run_bounded

WORLD = 2


def _state(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(100, generator=g)}


def _scenario(rank: int, local: str, shared: str) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from damage import flip_byte
    from resilient.checkpoint import Checkpointer
    from resilient.checkpoint import root as roots
    from resilient.checkpoint.tiers import FileTier

    out: dict = {}
    with Checkpointer(local, create=True, tiers=[shared], timeout=60) as ck:
        for s in (1, 2):
            ck.save(s, _state(s)).wait()
        out["drained"] = ck.wait_tiers(30) if rank == 0 else True
        out["status_rank1"] = ck.tier_status() if rank == 1 else []
    dist.barrier()
    if rank == 0:  # the node's local disk is gone; fetching is slow
        os.rename(local, local + ".lost")
        fetch = FileTier.fetch

        def slow(self, step, dest):
            time.sleep(3)
            return fetch(self, step, dest)

        FileTier.fetch = slow
    dist.barrier()
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with Checkpointer(local, tiers=[shared], timeout=60, collective_timeout=1) as ck:
        out["fresh"] = ck.load(target)
    out["fresh_equal"] = all(torch.equal(target[k], v) for k, v in _state(2).items())
    dist.barrier()
    if rank == 1:  # rank 1's shard of the root's copy is damaged
        flip_byte(os.path.join(roots.step_dir(local, 2), "rank-00001.data"), 128)
    dist.barrier()
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with Checkpointer(local, tiers=[shared], timeout=60) as ck:
        out["refetched"] = ck.load(target)
        out["skipped"] = ck.last_load.skipped
    out["refetched_equal"] = all(torch.equal(target[k], v) for k, v in _state(2).items())
    return out


def _worker(rank: int, port: int, local: str, shared: str, result_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        out = _scenario(rank, local, shared)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.mark.timeout(200)
def test_two_ranks_fill_a_fresh_root_and_refetch_a_damaged_copy(tmp_path):
    rc, output = run_bounded([sys.executable, __file__, str(tmp_path / "local"),
                              str(tmp_path / "shared"), str(tmp_path)], 150, "scenario")
    assert rc == 0, output[-4000:]
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    for r in results:
        assert r["drained"] is True
        assert r["fresh"] == 2 and r["fresh_equal"], r
        assert r["refetched"] == 2 and r["refetched_equal"] and r["skipped"] == [], r
    assert results[1]["status_rank1"] == []  # only rank 0 drains


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    port = free_port()
    mp.start_processes(_worker, args=(port, *sys.argv[1:4]), nprocs=WORLD,
                       start_method="spawn")
