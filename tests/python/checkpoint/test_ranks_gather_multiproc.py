"""Ranks.gather and Ranks.enter on 3 gloo processes: objects of random sizes (a few bytes to
hundreds of kilobytes, so both the one-round and the two-round path, and the slot's growth) come
back exactly, in rank order, on every rank; entries of one operation with one argument pass;
a different argument, or a different operation, raises CollectiveError on every rank, naming
each rank's call; a checked entry raises before the caller does anything else; a rank that
comes after the others gave up raises at its entry; an abort makes the next entry raise on
every rank; a save's stats say how long it waited in its collectives.

Runs in child processes started by this file's __main__ (own session, killed on timeout).

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_ranks_gather.py."""

from __future__ import annotations

import json
import os
import pickle
import random
import sys
import time

import pytest

from procs import run_bounded

WORLD = 3


ROUNDS = 40


def _object(seed: int, rank: int, i: int) -> object:
    """Rank `rank`'s object of gather `i`: any rank can rebuild any other's."""
    rng = random.Random(seed * 1000003 + rank * 1009 + i)
    size = rng.choice([0, 1, 7, 500, 1000, 1017, 1100, 5000, 70_000, 300_000])
    return {"rank": rank, "i": i, "blob": rng.randbytes(size), "n": rng.random()}


def _sized(n: int) -> bytes:
    """A bytes object whose gather payload (its pickle with the entry) is exactly n bytes."""
    for k in range(max(0, n - 64), n + 1):
        if len(pickle.dumps((None, b"x" * k), protocol=pickle.HIGHEST_PROTOCOL)) == n:
            return b"x" * k
    raise AssertionError(n)


def _worker(rank: int, port: int, out_dir: str, seeds: list[int]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from resilient.checkpoint.ranks import _SLOT_MIN, Ranks
    from resilient.errors import CollectiveError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    result: dict = {"mismatches": 0, "slots": {}, "slots_agree": {}}
    for seed in seeds:  # each seed's sizes on a fresh Ranks, as a job of its own would
        ranks = Ranks(True, None, None, 60, collective_timeout=30)
        slots = result["slots"][seed] = []
        for i in range(ROUNDS):
            got = ranks.gather(_object(seed, rank, i), fit=True)
            want = [_object(seed, r, i) for r in range(WORLD)]
            result["mismatches"] += got != want
            slots.append(ranks._slot)
        result["slots_agree"][seed] = len({tuple(s) for s in ranks.gather(slots)}) == 1
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

    # Objects whose pickles end exactly around the first round's capacity (slot - 8 bytes).
    edge = Ranks(True, None, None, 60, collective_timeout=30)
    for target in (_SLOT_MIN - 9, _SLOT_MIN - 8, _SLOT_MIN - 7, _SLOT_MIN, 2 * _SLOT_MIN):
        mine = _sized(target + rank)
        got = edge.gather(mine)
        result["mismatches"] += got != [_sized(target + r) for r in range(WORLD)]
    result["edge_slot"] = edge._slot  # only gathers made with fit=True grow it

    differ = Ranks(True, None, None, 60, collective_timeout=30)
    differ.enter("save", 10 + rank)
    result["differ"] = outcome(lambda: differ.gather("x"))
    result["differ_after"] = outcome(lambda: differ.enter("save", 20))
    ops = Ranks(True, None, None, 60, collective_timeout=30)
    done: list[str] = []
    result["ops"] = outcome(lambda: (ops.enter("load" if rank == 1 else "save", 3, check=True),
                                     done.append("went on")))
    result["ops_went_on"] = bool(done)
    # Ranks 0 and 1 give up on rank 2, which comes after they did: it raises at its entry
    # instead of meeting the all-gather they left posted in gloo.
    late = Ranks(True, None, None, 60, collective_timeout=1)
    if rank == 2:  # until both gave up (or far longer than their 1 s)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out_dir, f"gave-up{r}")) for r in range(2)):
            time.sleep(0.02)
    result["late"] = outcome(lambda: (late.enter("save", 7), late.gather(rank)))
    if rank < 2:
        open(os.path.join(out_dir, f"gave-up{rank}"), "w").close()
    dist.barrier()
    # An abort on one rank makes the next entry raise on every rank.
    aborted = Ranks(True, None, None, 60, collective_timeout=30)
    if rank == 0:
        aborted.abort("rank 9 failed")
    dist.barrier()
    result["aborted"] = outcome(lambda: (aborted.enter("save", 8), aborted.gather(rank)))
    # A later save whose steps differ: every rank raises and nothing is written.
    from resilient.checkpoint import Checkpointer

    root = os.path.join(out_dir, "ckpt")
    ck = Checkpointer(root, keep=3, create=True, collective_timeout=30)
    ck.save(1, {"w": torch.ones(4)}).wait()
    dist.barrier()
    if rank == 2:  # the others wait for it in the save's collectives
        time.sleep(0.5)
    h = ck.save(2, {"w": torch.ones(4)})
    h.wait()
    result["collective_s"] = h.stats()["collective_s"]
    result["later_differ"] = outcome(lambda: ck.save(3 + rank, {"w": torch.zeros(4)}))
    dist.barrier()
    result["later_listing"] = sorted(os.listdir(root))
    ck.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_gathers_of_any_size_and_entries_agree_on_every_rank(tmp_path):
    seeds = [1, 2]  # two draws of sizes, in one job (the rest does not depend on the seed)
    rc, output = run_bounded([sys.executable, __file__, str(tmp_path), ",".join(map(str, seeds))],
                             180, "scenario")
    assert rc == 0, output[-4000:]
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD)]
    for r in results:
        assert r["mismatches"] == 0, r
        for seed in map(str, seeds):  # JSON keys
            assert r["slots_agree"][seed], r
            assert r["slots"][seed][-1] == 64 << 10  # large objects grew the slot to its cap
        assert r["same_entry"] and r["same_entry_checked"], r
        assert "different arguments" in r["differ"], r["differ"]
        assert all(f"save({10 + k})" in r["differ"] for k in range(WORLD)), r["differ"]
        assert "out of step" in r["differ_after"], r["differ_after"]
        assert "different checkpoint operations" in r["ops"], r["ops"]
        assert "load(3)" in r["ops"] and "save(3)" in r["ops"], r["ops"]
        assert not r["ops_went_on"]
        assert r["edge_slot"] == 1024, r
        assert "abandoned" in r["aborted"] and "rank 9 failed" in r["aborted"], r["aborted"]
        assert "different arguments" in r["later_differ"], r["later_differ"]
        steps = [n for n in r["later_listing"] if "step" in n]
        assert steps == ["step-000000000001", "step-000000000002"], r["later_listing"]
    assert [r["collective_s"] >= 0.4 for r in results] == [True, True, False], results
    for r in results[:2]:
        assert "only 2 of 3 ranks" in r["late"], r["late"]
    assert "abandoned by another rank" in results[2]["late"], results[2]["late"]
    assert "only 2 of 3 ranks" in results[2]["late"], results[2]["late"]


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    mp.start_processes(_worker, args=(free_port(), sys.argv[1],
                                      [int(s) for s in sys.argv[2].split(",")]),
                       nprocs=WORLD, start_method="spawn")
