"""Megatron-style tensor x data parallel training with hand-written column- and row-parallel
linear layers, checkpointed with sharded saves (ShardSpec) and exact resume.

    torchrun --standalone --nproc-per-node 4 examples/megatron_train.py --tp 2 --ckpt /tmp/mckpt
    python examples/megatron_train.py --nproc 4 --tp 2 --ckpt /tmp/mckpt  # torch.multiprocessing

Ranks are laid out as rank = dp_rank * tp + tp_rank. The MLP's first linear is split by output
rows across the tensor-parallel group (column parallel), the second by input columns (row
parallel); the embedding and the head are replicated. Each checkpointed shard records its global
shape and offset, so a checkpoint taken with --tp 2 loads with --tp 1 or --tp 4 (--resave writes
the restored state back at the same step and exits; tests compare the global tensors).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient import CheckpointManager, ResumableSampler, forever
from resilient.checkpoint import ShardSpec

VOCAB, DIM, HIDDEN = 32, 16, 64


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the tensor-parallel group backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over the tensor-parallel group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class ParallelMLP(nn.Module):
    """embed -> column-parallel fc1 -> gelu -> row-parallel fc2 (+ bias) -> head."""

    def __init__(self, tp: int, tp_rank: int, tp_group: object) -> None:
        super().__init__()
        self.tp_group = tp_group
        g = torch.Generator().manual_seed(0)  # global weights are identical for every layout
        self.embed = nn.Parameter(torch.randn(VOCAB, DIM, generator=g) * 0.1)
        fc1_w, fc1_b = torch.randn(HIDDEN, DIM, generator=g) * 0.1, torch.zeros(HIDDEN)
        fc2_w, fc2_b = torch.randn(DIM, HIDDEN, generator=g) * 0.1, torch.zeros(DIM)
        rows = slice(tp_rank * HIDDEN // tp, (tp_rank + 1) * HIDDEN // tp)
        self.fc1_w, self.fc1_b = (
            nn.Parameter(fc1_w[rows].clone()),
            nn.Parameter(fc1_b[rows].clone()),
        )
        self.fc2_w, self.fc2_b = nn.Parameter(fc2_w[:, rows].clone()), nn.Parameter(fc2_b)
        self.head = nn.Parameter(torch.randn(VOCAB, DIM, generator=g) * 0.1)
        self.specs = {
            "fc1_w": ShardSpec.split((HIDDEN, DIM), 0, tp_rank, tp),
            "fc1_b": ShardSpec.split((HIDDEN,), 0, tp_rank, tp),
            "fc2_w": ShardSpec.split((DIM, HIDDEN), 1, tp_rank, tp),
        }

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(self.embed[tokens], self.tp_group)
        h = nn.functional.gelu(x @ self.fc1_w.t() + self.fc1_b)
        y = _ReduceFromTP.apply(h @ self.fc2_w.t(), self.tp_group) + self.fc2_b
        return y @ self.head.t()


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp
    dp, tp_rank, dp_rank = world // tp, rank % tp, rank // tp
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    torch.manual_seed(1234 + dp_rank)
    data = torch.randint(0, VOCAB, (512, 2), generator=torch.Generator().manual_seed(1))
    ds = TensorDataset(data)
    sampler = ResumableSampler(DistributedSampler(ds, num_replicas=dp, rank=dp_rank, seed=0))
    loader = DataLoader(ds, batch_size=8, sampler=sampler, generator=torch.Generator())
    model = ParallelMLP(tp, tp_rank, tp_group)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    # the optimizer's state of a sliced parameter inherits its spec (saved by parameter name)
    specs = {f"model/{n}": s for n, s in model.specs.items()}
    ckpt = CheckpointManager(
        args.ckpt,
        {"model": model, "optim": opt, "sched": sched},
        rank_state={"sampler": sampler},
        every=args.save_every,
        specs=specs,
        create=True,
    )
    step = ckpt.restore()
    if args.resave:
        ckpt.save(step)
        ckpt.close(120)
        return
    losses = {}
    batches = forever(loader)
    while step < args.steps:
        (pair,) = next(batches)
        logits = model(pair[:, 0])
        loss = nn.functional.cross_entropy(logits, pair[:, 1])
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data-parallel gradient average, fixed order
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp
        opt.step()
        sched.step()
        step += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = (mean / world).item()
        saved = ckpt.step(step)
        if step == args.kill_at:
            if saved is None:
                ckpt.save(step)
            ckpt.wait(120)
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close(120)
    if args.out:
        params = {
            n: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()[:16]
            for n, p in model.named_parameters()
        }
        with open(f"{args.out}.rank{rank}", "w") as f:
            json.dump({"losses": {k: v.hex() for k, v in losses.items()}, "params": params}, f)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--resave", action="store_true", help="restore, save the same step, exit")
    p.add_argument("--out", default="", help="write losses and parameter hashes to OUT.rank<r>")
    p.add_argument("--nproc", type=int, default=0, help="spawn N processes (without torchrun)")
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = args.nproc or 1
    mp.start_processes(_worker, args=(n, port, args), nprocs=n, start_method="spawn")


if __name__ == "__main__":
    main()
