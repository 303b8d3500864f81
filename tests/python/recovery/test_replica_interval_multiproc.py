"""RESILIENT_REPLICA_EVERY=0: the replicas' interval chosen so that a send fits, the same on
every rank (resilient.recovery.replica.choose_every, PeerReplicas._agree_interval).

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_replica_interval.py."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from procs import spawn_ranks
from resilient.recovery import replica
from resilient.recovery.replica import MARGIN

SEND_SLEEP_S = 0.03  # per point-to-point send: three per snapshot (header, meta, bytes)


STEP_S = 0.01


def _replicas(rank: int, port: int) -> replica.PeerReplicas:
    """A 2-rank gloo job (rank 0 and 1 on hosts of their own) and its replicas, interval
    chosen."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return replica.PeerReplicas(model, opt, every=0, host=f"host{rank}")


def _worker(rank: int, port: int, out: dict) -> None:
    reps = _replicas(rank, port)
    try:
        send = reps._send

        def slow_send(t: torch.Tensor, dst: int) -> None:  # a slow link: the send does not
            time.sleep(SEND_SLEEP_S * (1 + rank))  # fit in a step; rank 1's is the slowest
            send(t, dst)

        reps._send = slow_send
        taken = []
        for step in range(1, 61):
            time.sleep(STEP_S)  # the step's training
            if reps.replicate(step):
                taken.append(step)
        reps.drain(taken[-1], timeout_s=30)
        out[rank] = (taken, reps.every, reps.stats.waits, reps.stats.send_s)
        reps.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_agree_on_an_interval_the_slowest_send_fits_in() -> None:
    """Both ranks snapshot the same steps, spaced so that the slowest rank's send (rank 1:
    3 x 60 ms) fits with the margin, and the training thread never waits for a send."""
    res = spawn_ranks(_worker)
    (taken0, every0, waits0, send0), (taken1, every1, waits1, send1) = res[0], res[1]
    assert taken0 == taken1  # a step held for every rank always exists
    assert every0 == every1
    slowest = max(send0, send1)
    assert slowest >= 3 * 2 * SEND_SLEEP_S
    # a send of >= 180 ms against steps of >= 10 ms: several steps (a loaded machine makes
    # the measured step longer, so the interval shorter, but not 1), and not absurdly many
    assert 1 < every0 <= math.ceil(MARGIN * slowest / STEP_S), (every0, slowest)
    # the first at once; then, while it is still being sent, the agreements at the next due
    # steps skip their snapshots with ever longer intervals, until the send's time is known
    assert taken0[0] == 1 and len(taken0) >= 2, taken0
    assert all(b - a == every0 for a, b in zip(taken0[1:], taken0[2:])), taken0
    assert waits0 == waits1 == 0  # an agreement never waits for a send


def _broken_worker(rank: int, port: int, out: dict) -> None:
    """Rank 1's replication breaks after its first snapshot (a send that failed); rank 0's
    goes on. Both still agree on the interval at the second due step."""
    reps = _replicas(rank, port)
    try:
        taken = []
        for step in range(1, 21):
            time.sleep(STEP_S)
            if reps.replicate(step):
                taken.append(step)
            if step == 1 and rank == 1:
                reps.drain(1, timeout_s=30)  # its first snapshot went out; then it breaks
                reps._break("send: emulated")
        out[rank] = (taken, reps.every, reps._scheduled)
        reps.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_rank_whose_replication_broke_still_takes_part_in_the_interval() -> None:
    res = spawn_ranks(_broken_worker)
    (taken0, every0, due0), (taken1, every1, due1) = res[0], res[1]
    assert taken1 == [1]  # nothing after the break
    assert taken0[0] == 1 and len(taken0) > 2, taken0  # the other rank goes on
    assert every0 == every1 and due0 == due1  # one schedule, broken or not
