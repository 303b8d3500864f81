"""Ranks.gather and Ranks.enter on 3 gloo processes: objects of random sizes (a few bytes to
hundreds of kilobytes, so both the one-round and the two-round path, and the slot's growth) come
back exactly, in rank order, on every rank; entries of one operation with one argument pass;
a different argument, or a different operation, raises CollectiveError on every rank, naming
each rank's call; a checked entry raises before the caller does anything else.

Runs in child processes started by this file's __main__ (own session, killed on timeout)."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

from procs import run_bounded

WORLD = 3
ROUNDS = 40


def _object(seed: int, rank: int, i: int) -> object:
    """Rank `rank`'s object of gather `i`: any rank can rebuild any other's."""
    rng = random.Random(seed * 1000003 + rank * 1009 + i)
    size = rng.choice([0, 1, 7, 500, 1000, 1017, 1100, 5000, 70_000, 300_000])
    return {"rank": rank, "i": i, "blob": rng.randbytes(size), "n": rng.random()}


def _worker(rank: int, port: int, out_dir: str, seed: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from resilient.checkpoint.ranks import Ranks
    from resilient.errors import CollectiveError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    result: dict = {"mismatches": 0, "slots": []}
    ranks = Ranks(True, None, None, 60, collective_timeout=30)
    for i in range(ROUNDS):
        got = ranks.gather(_object(seed, rank, i))
        want = [_object(seed, r, i) for r in range(WORLD)]
        result["mismatches"] += got != want
        result["slots"].append(ranks._slot)
    result["slots_agree"] = len({tuple(s) for s in ranks.gather(result["slots"])}) == 1
    ranks.enter("save", 5)
    result["same_entry"] = ranks.gather(rank) == list(range(WORLD))
    ranks.enter("save", 5, check=True)
    result["same_entry_checked"] = ranks.gather(-rank) == [0, -1, -2]

    def outcome(call) -> str:
        try:
            call()
            return "returned"
        except CollectiveError as e:
            return str(e)

    differ = Ranks(True, None, None, 60, collective_timeout=30)
    differ.enter("save", 10 + rank)
    result["differ"] = outcome(lambda: differ.gather("x"))
    result["differ_after"] = outcome(lambda: differ.enter("save", 20))
    ops = Ranks(True, None, None, 60, collective_timeout=30)
    done: list[str] = []
    result["ops"] = outcome(lambda: (ops.enter("load" if rank == 1 else "save", 3, check=True),
                                     done.append("went on")))
    result["ops_went_on"] = bool(done)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [1, 2])
def test_gathers_of_any_size_and_entries_agree_on_every_rank(tmp_path, seed):
    rc, output = run_bounded([sys.executable, __file__, str(tmp_path), str(seed)], 180,
                             "scenario")
    assert rc == 0, output[-4000:]
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    for r in results:
        assert r["mismatches"] == 0 and r["slots_agree"], r
        assert r["slots"][-1] > 1024  # a large object grew the one-round slot
        assert r["same_entry"] and r["same_entry_checked"], r
        assert "different arguments" in r["differ"], r["differ"]
        assert all(f"save({10 + k})" in r["differ"] for k in range(WORLD)), r["differ"]
        assert "out of step" in r["differ_after"], r["differ_after"]
        assert "different checkpoint operations" in r["ops"], r["ops"]
        assert "load(3)" in r["ops"] and "save(3)" in r["ops"], r["ops"]
        assert not r["ops_went_on"]


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    mp.start_processes(_worker, args=(free_port(), sys.argv[1], int(sys.argv[2])),
                       nprocs=WORLD, start_method="spawn")
