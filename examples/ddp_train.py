"""A small transformer language model trained with DDP on synthetic tokens, checkpointed with
resilient.checkpoint.manager.CheckpointManager (sharded async saves, exact resume).

    torchrun --standalone --nproc-per-node 4 examples/ddp_train.py --steps 20 --ckpt /tmp/ckpt
    python examples/ddp_train.py --nproc 4 --steps 20 --ckpt /tmp/ckpt     # torch.multiprocessing

Run it again with the same --ckpt and it resumes from the newest checkpoint. --kill-at K saves at
step K, waits for the commit, then SIGKILLs every rank (a crash test). --out FILE (rank 0) writes
the per-step losses and a hash of the final parameters as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient import CheckpointManager, ResumableSampler, forever

VOCAB, SEQ, DIM = 64, 16, 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        layer = nn.TransformerEncoderLayer(
            DIM, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True
        )
        self.body = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(
            self.body(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        )


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # identical initial weights on every rank
    random.seed(rank)
    np.random.seed(rank)
    data = torch.randint(0, VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(1))
    sampler = ResumableSampler(
        DistributedSampler(TensorDataset(data), num_replicas=world, rank=rank, seed=0)
    )
    # Its own generator: creating a DataLoader iterator draws a seed, which must not consume the
    # global torch RNG (a resumed run creates one more iterator than the uninterrupted run).
    loader = DataLoader(
        TensorDataset(data), batch_size=4, sampler=sampler, generator=torch.Generator()
    )
    # find_unused_parameters=True keeps DDP's gradient buckets fixed for the whole run. Without it
    # DDP re-buckets after its first iteration, so the first step after a restart sums gradients
    # in a different layout (and float order) than the uninterrupted run: equal, but not bitwise.
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    ids = [device.index] if device.type == "cuda" else None
    model = DDP(TinyLM().to(device), device_ids=ids, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    ckpt = CheckpointManager(
        args.ckpt,
        {"model": model, "optim": opt, "sched": sched},
        rank_state={"sampler": sampler},
        every=args.save_every,
        create=True,  # a fresh run starts at step 0; a resumed one continues
    )
    step = ckpt.restore()
    if args.resave:  # e.g. after restoring onto a different number of ranks
        ckpt.save(step)
        ckpt.close(120)
        return
    losses = {}
    batches = forever(loader)
    while step < args.steps:
        (seq,) = next(batches)
        shift = random.randint(0, 2) + int(np.random.randint(0, 2))  # exercises Python/NumPy RNG
        seq = torch.roll(seq, shifts=shift, dims=1).to(device)
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
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
    if rank == 0 and args.out:
        params = {
            n: hashlib.sha256(p.detach().cpu().numpy().tobytes()).hexdigest()[:16]
            for n, p in model.module.state_dict().items()
        }
        with open(args.out, "w") as f:
            json.dump({"losses": {k: v.hex() for k, v in losses.items()}, "params": params}, f)


def _backend(args: argparse.Namespace) -> str:
    return "nccl" if args.device == "cuda" else "gloo"


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group(
        _backend(args), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--out", default="")
    p.add_argument("--resave", action="store_true", help="restore, save the same step, exit")
    p.add_argument("--nproc", type=int, default=0, help="spawn N processes (without torchrun)")
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, one GPU per rank"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(_backend(args))
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _worker, args=(args.nproc or 1, port, args), nprocs=args.nproc or 1, start_method="spawn"
    )


if __name__ == "__main__":
    main()
