"""Peer replicas of FSDP2 shards: 4 CPU ranks replicate in the background, rank 3 is SIGKILLed,
and the survivors (resharding to 3 ranks, or with a spare taking its place) restore the full
state of the newest step held in memory, equal to the state before the loss. A damaged replica is
never loaded: the previous step's is, or ReplicaUnavailable on every rank."""


from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint.plan import ShardSpec
from resilient.recovery.replica import Entry, buddies
from resilient.recovery.reshard import (
    ReplicaUnavailable,
    candidate_steps,
    choose_step,
    plan_moves,
)

WORKER = Path(__file__).parents[1] / "fsdp_replica_worker.py"


def _run(tmp_path: Path, scenario: str) -> dict[int, dict]:
    lost = 1 if scenario.endswith("1") else 3
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), "member", str(r), str(store.port),
                               str(tmp_path), scenario], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(4)]
    if scenario.startswith("spare"):
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "spare", "4",
                                       str(store.port), str(tmp_path), scenario], env=env,
                                      start_new_session=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + 100
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the FSDP2 replica job timed out:\n" + "\n".join(
            (p.communicate()[0] or "")[-2000:] for p in procs))
    assert procs[lost].returncode == -signal.SIGKILL, outs[lost][-3000:]
    for i, p in enumerate(procs):
        if i != lost:
            assert p.returncode == 0, "\n".join(f"[{j}] {o[-1500:]}" for j, o in enumerate(outs))
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}


@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=12), st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_buddies_spread_over_hosts(hosts: list[str], factor: int) -> None:
    plan = buddies(hosts, factor)
    world = len(hosts)
    if world == 1:
        assert plan == [[]]
        return
    k = min(factor, world - 1)
    held = [0] * world
    for r, mine in enumerate(plan):
        assert len(mine) == len(set(mine)) == k and r not in mine
        for b in mine:
            held[b] += 1
    assert held == [k] * world  # every rank holds as many replicas as it has buddies
    sizes = {h: hosts.count(h) for h in hosts}
    if len(set(sizes.values())) == 1 and len(sizes) > k:  # equal hosts: buddies elsewhere
        assert all(hosts[b] != hosts[r] for r, mine in enumerate(plan) for b in mine)


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 chunks (torch.chunk): ceil(n / parts) rows each, the last ones short."""
    size = -(-n // parts)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


@given(st.integers(1, 40), st.integers(1, 5), st.integers(1, 6), st.integers(1, 6),
       st.data())
@settings(max_examples=200, deadline=None)
def test_moves_tile_every_target(rows: int, cols: int, old_world: int, new_world: int,
                                 data: st.DataObject) -> None:
    """For any old and new dim-0 sharding, the moves cover each new rank's chunk exactly once,
    from the old ranks' chunks, and a replicated tensor comes from one holder."""
    holders = {o: data.draw(st.integers(0, new_world - 1)) for o in range(old_world)}
    sources: dict[int, list[Entry]] = {}
    for o, (lo, hi) in enumerate(_chunks(rows, old_world)):
        sources[o] = [Entry('["w"]', "torch.float32", (rows, cols), (lo, 0), (hi - lo, cols), 0,
                            4 * (hi - lo) * cols, False),
                      Entry('["step"]', "torch.float32", (), (), (), 0, 4, True)]
    targets = [[('["w"]', "torch.float32", ShardSpec((rows, cols), (lo, 0), (hi - lo, cols)),
                 False), ('["step"]', "torch.float32", ShardSpec((), (), ()), True)]
               for lo, hi in _chunks(rows, new_world)]
    moves = plan_moves(targets, sources, holders)
    for j, (lo, hi) in enumerate(_chunks(rows, new_world)):
        got = sorted(m.dst[0] for m in moves if m.needer == j and m.key == '["w"]')
        at = 0
        for a, b in got:
            assert a == at and b > a
            at = b
        assert at == hi - lo
        steps = [m for m in moves if m.needer == j and m.key == '["step"]']
        assert len(steps) == 1
        if j in holders.values():
            assert steps[0].holder == j  # a rank holding a copy takes its own
    for m in moves:
        assert m.holder == holders[m.old]
        assert m.nbytes == 4 * (m.src[0][1] - m.src[0][0]) * cols if m.src else 4


def test_choose_step_prefers_newest_complete_and_own_holder() -> None:
    offers = [{(0, 3): [4, 5], (2, 3): [4]}, {(1, 3): [4, 5], (0, 3): [4, 5]}, {}]
    step, world, holders = choose_step(offers, [0, 1, -1])
    assert (step, world) == (4, 3) and holders == {0: 0, 1: 1, 2: 0}
    with pytest.raises(ReplicaUnavailable, match="old ranks' shards"):
        choose_step([{(0, 2): [5]}, {}], [0, -1])
    with pytest.raises(ReplicaUnavailable, match="no replicated state"):
        choose_step([{}, {}], [-1, -1])


def test_candidate_steps_list_partial_steps_newest_first() -> None:
    """A step where an old rank is held by nobody is still a candidate (HSDP: its boxes may be
    another rank's); choose_step keeps asking for every old rank."""
    offers = [{(0, 4): [5, 6], (2, 4): [5]}, {(1, 4): [5, 6]}, {(2, 4): [5, 6]}]
    old_world, cands = candidate_steps(offers, [0, 1, 2])
    assert old_world == 4
    assert cands == [(6, {0: 0, 1: 1, 2: 2}), (5, {0: 0, 1: 1, 2: 2})]
    with pytest.raises(ReplicaUnavailable, match="old ranks' shards"):
        choose_step(offers, [0, 1, 2])  # old rank 3 is held at no step
