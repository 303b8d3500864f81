"""CheckpointManager without torch.distributed: RNG streams (Python, NumPy, torch), a
ResumableSampler crossing an epoch boundary, optimizer and scheduler resume bit-exactly in a
fresh set of objects."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from resilient.checkpoint.manager import CheckpointManager, ResumableSampler, RNGState, forever


def make(root, seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    data = TensorDataset(torch.randn(10, 4, generator=torch.Generator().manual_seed(3)))
    sampler = ResumableSampler(RandomSampler(data, generator=torch.Generator().manual_seed(5)))
    loader = DataLoader(data, batch_size=3, sampler=sampler, generator=torch.Generator())
    ckpt = CheckpointManager(
        root, {"model": model, "opt": opt, "sched": sched}, rank_state={"sampler": sampler}, every=4
    )
    return model, opt, sched, loader, sampler, ckpt


def train(model, opt, sched, loader, ckpt, start, stop):
    losses, batches = {}, forever(loader)
    for step in range(start, stop):
        (x,) = next(batches)
        noise = random.random() + float(np.random.rand())
        loss = (model(x) + noise).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses[step + 1] = loss.item()
        ckpt.step(step + 1)
    return losses


def test_single_process_resume_is_bit_exact(tmp_path):
    model, opt, sched, loader, _, ckpt = make(tmp_path / "a", seed=1)
    ref = train(model, opt, sched, loader, ckpt, 0, 9)  # 4 batches per epoch: crosses epochs
    ckpt.close()
    ref_params = [p.detach().clone() for p in model.parameters()]

    model, opt, sched, loader, _, ckpt = make(tmp_path / "b", seed=1)
    train(model, opt, sched, loader, ckpt, 0, 6)  # saved at step 4 (mid-epoch 2)
    ckpt.close()
    model, opt, sched, loader, sampler, ckpt = make(tmp_path / "b", seed=99)  # "restart"
    start = ckpt.restore()
    assert start == 4
    assert {k: sampler.state_dict()[k] for k in ("epoch", "consumed")} == {
        "epoch": 1,
        "consumed": 0,
    }
    got = train(model, opt, sched, loader, ckpt, start, 9)
    ckpt.close()
    assert got == {s: ref[s] for s in range(5, 10)}
    assert all(torch.equal(a, b) for a, b in zip(ref_params, model.parameters()))


def test_sampler_resumes_mid_epoch():
    base = RandomSampler(range(7), generator=torch.Generator().manual_seed(0))
    s = ResumableSampler(base)
    it = iter(s)
    first = [next(it) for _ in range(3)]
    state = s.state_dict()
    rest = list(it)
    assert (state["epoch"], state["consumed"]) == (0, 3)
    assert (s.epoch, s.consumed) == (1, 0)
    base2 = RandomSampler(range(7), generator=torch.Generator().manual_seed(0))
    s2 = ResumableSampler(base2)
    s2.load_state_dict(state)
    assert list(s2) == rest and sorted(first + rest) == list(range(7))


def test_rng_state_round_trip():
    rng = RNGState()
    saved = rng.state_dict()
    a = (random.random(), float(np.random.rand()), torch.rand(2))
    rng.load_state_dict(saved)
    b = (random.random(), float(np.random.rand()), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
