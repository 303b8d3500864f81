"""DistributedCheckpointer across 2 gloo processes: balanced shards, per-rank state, a failing
rank (no commit, error on every rank, previous step intact), retention, the redistributing
restore, and a shape mismatch.

The scenario runs in child processes started by this file's __main__ (a subprocess with its own
session, killed as a group on timeout), so no test can leave processes behind.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from procs import run_bounded

WORLD = 2


def _scenario(rank: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from resilient.distributed import CheckpointCommitError, DistributedCheckpointer

    out: dict = {}
    big = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)  # 2 MiB: split by rows
    small = {f"b{i}": torch.full((100 + i,), float(i)) for i in range(8)}
    state = {"w": big.clone(), "small": {k: v.clone() for k, v in small.items()}, "lr": 0.25}
    mine = {"x": torch.full((3,), float(rank)), "n": rank}
    ckpt = DistributedCheckpointer(root, keep=2, timeout=60)

    ckpt.save(1, state, mine).wait(60)
    manifest = json.load(open(os.path.join(root, "step-000000000001", "manifest.json")))
    out["shard_bytes"] = [s["bytes"] for s in manifest["shards"]]

    state["w"].zero_()
    for v in state["small"].values():
        v.zero_()
    state["lr"] = 0.0
    mine["x"].zero_()
    mine["n"] = -1
    assert ckpt.load(state, mine) == 1
    assert torch.equal(state["w"], big) and state["lr"] == 0.25
    assert all(torch.equal(state["small"][k], v) for k, v in small.items())
    assert torch.equal(mine["x"], torch.full((3,), float(rank))) and mine["n"] == rank

    # Rank 1's shard cannot be written: nothing may be committed, every rank hears why.
    if rank == 1:
        os.makedirs(os.path.join(root, ".tmp-step-000000000002", "rank-00001.data"))
    dist.barrier()
    handle = ckpt.save(2, state, mine)
    try:
        handle.wait(60)
        out["failed_save"] = "committed"
    except CheckpointCommitError as e:
        out["failed_save"] = str(e)
    out["steps_after_failure"] = ckpt.steps()
    assert ckpt.load(state, mine) == 1

    ckpt.save(3, state, mine).wait(60)
    ckpt.save(4, state, mine).wait(60)

    # The same step restored with the storage read once and the pieces broadcast.
    ckpt.restore = "redistribute"
    state["w"].zero_()
    mine["x"].zero_()
    assert ckpt.load(state, mine) == 4
    assert torch.equal(state["w"], big) and torch.equal(mine["x"], torch.full((3,), float(rank)))
    ckpt.restore = "direct"
    out["steps_after_retention"] = ckpt.steps()
    out["leftovers"] = sorted(n for n in os.listdir(root)
                              if n.startswith(".") and n != ".writer.lock")

    wrong = {"w": torch.zeros(256, 1024), "small": state["small"], "lr": 0.0}
    try:
        ckpt.load(wrong, mine)
        out["mismatch"] = "loaded"
    except ValueError as e:
        out["mismatch"] = str(e)
    # Only rank 1 is wrong: with the collective read, rank 0 must hear it, not hang.
    ckpt.restore = "redistribute"
    one_wrong = wrong if rank == 1 else state
    try:
        ckpt.load(one_wrong, mine)
        out["mismatch_redistribute"] = "loaded"
    except ValueError as e:
        out["mismatch_redistribute"] = str(e)
    ckpt.close(60)
    return out


def _worker(rank: int, port: int, root: str, result_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        out = _scenario(rank, root)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def _run(root, result_dir, timeout=150):
    rc, output = run_bounded([sys.executable, __file__, str(root), str(result_dir)], timeout,
                             "scenario")
    assert rc == 0, output[-4000:]
    return [json.load(open(result_dir / f"rank{r}.json")) for r in range(WORLD)]


@pytest.mark.timeout(200)
def test_two_rank_sharded_checkpoints(tmp_path):
    results = _run(tmp_path / "ckpt", tmp_path)
    r0 = results[0]
    # Replicated state written once in total, about half by each rank (+ alignment, rank state).
    a, b = r0["shard_bytes"]
    assert 2 << 20 <= a + b <= (2 << 20) + 64 * 1024
    assert abs(a - b) <= 16 * 1024, (a, b)
    for r in results:
        assert "not committed" in r["failed_save"] and "rank 1" in r["failed_save"], r[
            "failed_save"
        ]
        assert r["steps_after_failure"] == [1]
        assert r["steps_after_retention"] == [3, 4]
        assert r["leftovers"] == []
        assert "'w'" in r["mismatch"] and "[512, 1024]" in r["mismatch"], r["mismatch"]
        assert "'w'" in r["mismatch_redistribute"], r["mismatch_redistribute"]


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    port = free_port()
    root_dir, results_dir = sys.argv[1], sys.argv[2]
    mp.start_processes(
        _worker, args=(port, root_dir, results_dir), nprocs=WORLD, start_method="spawn"
    )
