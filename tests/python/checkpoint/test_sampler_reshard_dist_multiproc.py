"""A DataLoader with ResumableSampler(DistributedSampler) under CheckpointManager across world
changes, one epoch of 40 samples: 2 ranks take 3 batches and save, 3 ranks resume (rank 2 has no
saved sampler state: the manager gives it the others' position), take 2 batches and save, then 2
ranks finish the epoch. Every sample is seen once, beyond DistributedSampler's padding."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest

from procs import run_bounded

N, BATCH = 40, 2


def _worker(rank: int, world: int, port: int, root: str, batches: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from resilient import CheckpointManager, ResumableSampler

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    data = TensorDataset(torch.arange(N))
    sampler = ResumableSampler(DistributedSampler(data, seed=5))  # the group's rank and size
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    w = torch.zeros(1)
    ckpt = CheckpointManager(root, {"w": w}, rank_state={"sampler": sampler}, every=0,
                             create=True)
    step = ckpt.restore()
    seen, epoch = [], sampler.epoch
    for i, (x,) in enumerate(loader):
        seen += x.tolist()
        if batches and i + 1 == batches:
            break
    if batches:
        ckpt.save(step + batches)
    ckpt.close()
    with open(os.path.join(out, f"{world}-{rank}.json"), "w") as f:
        json.dump({"seen": seen, "epoch": epoch, "step": step, "after": sampler.epoch}, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown at interpreter exit (see test_load_contract_dist)


def _run(world: int, root, out, batches: int) -> list[dict]:
    rc, output = run_bounded([sys.executable, __file__, str(world), str(root), str(batches),
                              str(out)], 150, f"world {world}")
    assert rc == 0, output[-4000:]
    return [json.load(open(out / f"{world}-{r}.json")) for r in range(world)]


@pytest.mark.timeout(400)
def test_an_epoch_survives_a_grown_and_a_shrunk_world(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path
    first = _run(2, root, out, 3)
    second = _run(3, root, out, 2)
    assert [r["step"] for r in second] == [3, 3, 3]
    assert all(r["epoch"] == 0 for r in second)  # rank 2 too: it took the others' position
    third = _run(2, root, out, 0)
    assert [r["step"] for r in third] == [5, 5]
    assert all(r["after"] == 1 for r in third)  # the epoch ended
    seen = [i for phase in (first, second, third) for r in phase for i in r["seen"]]
    counts = Counter(seen)
    assert set(counts) == set(range(N))  # nothing lost
    # 12 + 12 consumed, 16 left over 2 ranks: no padding anywhere, so nothing twice
    assert len(seen) == N, counts


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    port = free_port()
    world = int(sys.argv[1])
    mp.start_processes(_worker, args=(world, port, sys.argv[2], int(sys.argv[3]), sys.argv[4]),
                       nprocs=world, start_method="spawn")
