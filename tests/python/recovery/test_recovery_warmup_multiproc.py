"""The rebuilt groups' warm-up (resilient.recovery.warmup): what it warms, that its
collectives pair across ranks, and that a failed warm-up fails the restore.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_recovery_warmup.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from test_recovery_warmup import _nested, _poll

from procs import spawn_ranks
from resilient.recovery import warmup


def _short_worker(rank: int, port: int, out: dict) -> None:
    """Rank 1 cannot allocate its buffers: neither rank issues anything but the vote."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 1:
            def no_memory(*_a):
                raise torch.OutOfMemoryError("CUDA out of memory (emulated)")

            warmup.allocate = no_memory
        w = warmup.Warmup([dist.group.WORLD], [(64, torch.float32)], torch.device("cpu"))
        warmed = w.start().finish(_poll)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)  # the next collective pairs with the peer's next one
        out[rank] = (warmed, w.works, t.item())
    finally:
        dist.destroy_process_group()


def test_a_rank_without_memory_for_the_buffers_makes_every_rank_skip():
    assert spawn_ranks(_short_worker) == {0: (False, [], 3.0), 1: (False, [], 3.0)}


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # uneven shards: rank 1 holds none of the last layer (one output row, one bias)
        sizes = warmup.plan(_nested([(7, 5), (5, 1)]))
        assert sizes == [(7 * 5 + 5, torch.float32)]  # unsharded: the same on both ranks
        w = warmup.Warmup([dist.group.WORLD], sizes + [(70_001, torch.float64)],
                          torch.device("cpu")).start()
        w.finish(_poll)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)  # the collectives after the warm-up still pair up
        big = torch.full((70_000,), float(rank))
        gathered = torch.empty(140_000)
        dist.all_gather_into_tensor(gathered, big)
        out[rank] = (t.item(), gathered[:70_000].sum().item(), gathered[70_000:].sum().item())
    finally:
        dist.destroy_process_group()


def test_two_ranks_warm_the_same_collectives_and_go_on_in_step():
    assert spawn_ranks(_worker) == {0: (3.0, 0.0, 70_000.0), 1: (3.0, 0.0, 70_000.0)}
