"""A small Llama-style decoder (RMSNorm, rotary attention, SwiGLU) trained with FSDP2 and, with
--tp 2, tensor parallelism on a 2-D mesh, checkpointed with resilient.CheckpointManager: each
rank saves its own shards (no ShardSpec), and a resumed run continues bit-exact.

    torchrun --standalone --nproc-per-node 4 examples/fsdp_train.py --steps 20 --ckpt /tmp/ckpt
    torchrun --standalone --nproc-per-node 4 examples/fsdp_train.py --tp 2 --ckpt /tmp/ckpt2
    python examples/fsdp_train.py --nproc 4 --steps 20 --ckpt /tmp/ckpt   # torch.multiprocessing

Run it again with the same --ckpt and it resumes from the newest checkpoint, on any mesh (a
changed --nproc or --tp reshards on load). --kill-at K saves at step K, waits for the commit,
then SIGKILLs every rank. --out FILE (rank 0) writes the per-step losses and a hash of every
full parameter as JSON. CPU runs use gloo (FSDP2 runs on CPU); --device cuda uses NCCL.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import signal
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient import CheckpointManager, ResumableSampler, forever

VOCAB, SEQ, DIM, HEADS, LAYERS = 96, 16, 32, 4, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (batch, seq, heads, head_dim)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs).to(x.device)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(DIM), RMSNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them
        q, k, v = (w(h).view(b, s, -1, DIM // HEADS) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q), rotary(k)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def shard(model: Decoder, world: int, tp: int, device: str) -> None:
    """FSDP2 over the data-parallel ranks; with tp > 1, tensor parallelism inside each block
    (column-parallel q, k, v, w1, w3; row-parallel wo, w2), as torchtitan lays it out."""
    mesh = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
                "wo": RowwiseParallel(), "w1": ColwiseParallel(), "w3": ColwiseParallel(),
                "w2": RowwiseParallel()}
        for block in model.layers:
            parallelize_module(block, mesh["tp"], plan)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_world = rank // args.tp, world // args.tp  # ranks of a TP group share the data
    torch.manual_seed(0)  # identical initial weights on every rank
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    data = torch.randint(0, VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(1))
    sampler = ResumableSampler(
        DistributedSampler(TensorDataset(data), num_replicas=dp_world, rank=dp_rank, seed=0))
    loader = DataLoader(TensorDataset(data), batch_size=4, sampler=sampler,
                        generator=torch.Generator())
    model = Decoder().to(device)
    shard(model, world, args.tp, device.type)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    ckpt = CheckpointManager(args.ckpt, {"model": model, "optim": opt, "sched": sched},
                             rank_state={"sampler": sampler}, every=args.save_every, create=True)
    step = ckpt.restore()
    losses, batches = {}, forever(loader)
    while step < args.steps:
        (seq,) = next(batches)
        seq = seq.to(device)
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
    full = {n: p.full_tensor() for n, p in model.state_dict().items()}  # collective
    # every rank uses the gathered tensors, so no gather is still in flight at exit
    params = {n: hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()[:16]
              for n, t in full.items()}
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": {k: v.hex() for k, v in losses.items()}, "params": params}, f)


def _shutdown() -> None:
    """Frees the model's process-group objects (FSDP modules hold them in reference cycles)
    while the interpreter still runs, then destroys the groups. Left to the collection at exit,
    a gloo thread finishing a collective would take the GIL of a finalizing interpreter and
    abort the process ("terminate called without an active exception")."""
    gc.collect()
    dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        train(args)
    finally:
        _shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1: FSDP only)")
    p.add_argument("--out", default="")
    p.add_argument("--nproc", type=int, default=0, help="spawn N processes (without torchrun)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # torchrun
        _worker_env(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = args.nproc or 1
    mp.start_processes(_worker, args=(n, port, args), nprocs=n, start_method="spawn")


def _worker_env(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        train(args)
    finally:
        _shutdown()


if __name__ == "__main__":
    main()
