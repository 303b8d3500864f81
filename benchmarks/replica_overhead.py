"""The cost of peer replication (resilient.recovery.replica) to an FSDP2 training step: one
process per GPU (NCCL), a stack of Linear layers trained with AdamW, in paired blocks of steps
with replication on and off (ABAB, the same processes), so both share the machine's state.

    python benchmarks/replica_overhead.py --gpus 4 --layers 24 --dim 4096 --json out.json

Prints and writes: seconds per step with and without replication (median of the blocks), their
ratio (goal <= 1.02), snapshots sent, how often and how long a step waited for the previous
snapshot's send, and the bytes per snapshot.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from resilient.recovery.replica import PeerReplicas

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.gpus, device_id=dev)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)]).to(dev)
    mesh = init_device_mesh("cuda", (args.gpus,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.dim, device=dev)
    replicas = PeerReplicas(model, opt, every=args.every)

    def step(i: int, replicate: bool) -> bool:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        return replicate and replicas.replicate(i)

    # Warm-up until every rank took two snapshots: both of a rank's snapshot buffers are
    # allocated (pinned) and the interval is agreed, so no block pays these one-time costs.
    taken, i = torch.zeros(1, device=dev), 0
    while taken.item() < 2 and i < 200:
        taken += step(i, True)
        mine = taken.clone()
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        taken.copy_(mine)
        i += 1
    warmup_steps = i
    torch.cuda.synchronize()
    dist.barrier()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for block in range(2 * args.blocks):
        mode = "on" if block % 2 else "off"
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(i, mode == "on")
            i += 1
        torch.cuda.synchronize()
        dist.barrier()
        times[mode].append((time.perf_counter() - t0) / args.steps)
    stats = vars(replicas.stats)
    replicas.close()
    if rank == 0:
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        out = {"gpus": args.gpus, "layers": args.layers, "dim": args.dim, "batch": args.batch,
               "steps_per_block": args.steps, "blocks": args.blocks,
               "warmup_steps": warmup_steps, "step_s_off": off,
               "step_s_on": on, "ratio": on / off, "blocks_off": times["off"],
               "blocks_on": times["on"], "snapshot_bytes": stats["bytes"],
               "every": replicas.every, "sent": stats["sent"], "waits": stats["waits"],
               "waited_s": stats["waited_s"],
               "copy_s_on_training_thread": stats["copy_s"], "errors": stats["errors"]}
        print(json.dumps(out, indent=1), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--blocks", type=int, default=4, help="blocks per mode")
    p.add_argument("--every", type=int, default=0,
                   help="RESILIENT_REPLICA_EVERY (0, the default: chosen from the send and step)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(args, port), nprocs=args.gpus, start_method="spawn")


if __name__ == "__main__":
    main()
