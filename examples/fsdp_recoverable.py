"""FSDP2 (``fully_shard``) training that survives a lost rank in the same processes: every rank's
shards are replicated to a peer's host memory after each step, and when a rank dies the
survivors (and a hot spare, if one waits) rebuild the model on the new group and fill it from
memory: the survivors' own shards plus the lost rank's replica, resharded over the new world.
The lines marked "# resilient" are what recovery adds to a plain FSDP2 loop.

    resilient run --standalone --nproc-per-node 4 examples/fsdp_recoverable.py --ckpt /tmp/f
    resilient run --standalone --nproc-per-node 4 --spares 1 examples/fsdp_recoverable.py ...

kill -9 one worker: the others finish (with --spares 1 the spare takes its place). --state-log
DIR (tests) writes the full-state hash at each step's start and end.
"""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient import CheckpointManager, Recovery, ResumableSampler, forever, joining
from resilient.chaos.faults import lose_device

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--state-log", default="")
p.add_argument("--sample-log", default="")
p.add_argument("--lose-device", default="", metavar="RANK:STEP",
               help="fault injection: that rank's device fails at that step (emulated on CPU)")
p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
               help="cuda: NCCL, one GPU per rank (LOCAL_RANK %% the GPU count)")
p.add_argument("--kill", default="", metavar="RANK:STEP",
               help="fault injection: that rank SIGKILLs itself at that step's start")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (tests)")
p.add_argument("--short-step-sleep", type=float, default=None,
               help="seconds each step sleeps while the world is smaller than at the start "
                    "(tests: a replacement's start on a loaded machine, not a step count, "
                    "decides when it rejoins); default: --step-sleep")
p.add_argument("--hsdp", action="store_true",
               help="HSDP (2 replica groups, each sharding the model) while the world is even "
                    "and >= 4; FSDP2 over every rank otherwise (e.g. 3 after a loss)")
p.add_argument("--tp", action="store_true",
               help="tensor parallel over pairs of ranks (the pair reads the same batches), "
                    "FSDP2 across the pairs, while the world is 4; FSDP2 over every rank "
                    "otherwise (e.g. 3 after a loss). NCCL only")
args = p.parse_args()
if args.tp and args.device == "cpu":
    # gloo cannot abort a collective, and DTensor's tensor-parallel collectives are not
    # polled: a rank waiting in one for a peer that went into recovery would wait until the
    # detector removed it as hung (docs/recovery.md). On NCCL the revoke ends them.
    p.error("--tp needs --device cuda (tensor-parallel collectives on gloo are not recovered)")
torch.set_num_threads(1)
if args.device == "cuda":
    DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl", device_id=DEVICE)
else:
    DEVICE = torch.device("cpu")
    dist.init_process_group("gloo")
first_rank = dist.get_rank()


def build(device: torch.device | str = DEVICE) -> nn.Module:
    """The model, sharded over the current default group (called again after a recovery)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                              nn.Linear(64, 1))
    world = dist.get_world_size()
    if args.tp and world == 4:  # layer 0 column-, layer 2 row-parallel within each pair
        mesh2 = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = mesh2["dp"]
    elif args.hsdp and world >= 4 and world % 2 == 0:
        mesh = init_device_mesh(DEVICE.type, (2, world // 2),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(DEVICE.type, (world,))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def data_parallel(world: int, rank: int) -> tuple[int, int]:
    """The samplers' split: a tensor-parallel pair reads the same batches."""
    return (world // 2, rank // 2) if args.tp and world == 4 else (world, rank)


def state_hash(rec: Recovery, model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of the full model and optimizer state, the same on any sharding. Collective: it
    gathers each tensor itself, asynchronously and through rec.wait, so that a peer lost
    meanwhile is recovered from like a failure of FSDP2's own collectives."""
    msd, osd = get_state_dict(model, opt)  # this rank's shards (no collective)
    h = hashlib.sha256()
    tensors = sorted(msd.items())
    tensors += [(f"{k}/{n}", t) for k, st in sorted(osd["state"].items())
                for n, t in sorted(st.items())]
    for key, t in tensors:
        if isinstance(t, DTensor) and (t.device_mesh.ndim > 1  # HSDP, TP: DTensor's gather
                                       or t.device_mesh.size() != rec.world_size):
            t = t.full_tensor()  # (not polled: a frozen peer would hold it; a lost one ends it)
        elif isinstance(t, DTensor):  # FSDP2: rows [rank * c, ...) of the global dim 0
            local, n = t.to_local(), t.shape[0]
            c = -(-n // rec.world_size)
            padded = torch.zeros((c, *local.shape[1:]), dtype=local.dtype, device=DEVICE)
            padded[:local.shape[0]] = local
            out = torch.empty((c * rec.world_size, *local.shape[1:]), dtype=local.dtype,
                              device=DEVICE)
            rec.wait(dist.all_gather_into_tensor(out, padded, async_op=True))
            t = out[:n]
        h.update(key.encode())
        h.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


x = torch.randn(1920, 16, generator=torch.Generator().manual_seed(1))
dataset = TensorDataset(x, x[:, :4].sum(1, keepdim=True), torch.arange(len(x)))
# A spare or replacement gets its state from the members when it joins: its first model holds
# nothing (on the meta device), so it never holds the whole model in its one-rank group.
joins = joining()                                                              # resilient
model = build("meta" if joins else DEVICE)                                     # resilient
if args.state_log and joins:
    with open(os.path.join(args.state_log, f"joiner{os.getpid()}.device"), "w") as f:
        f.write(str(next(model.parameters()).device))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
data_world, data_rank = data_parallel(dist.get_world_size(), dist.get_rank())
sampler = ResumableSampler(DistributedSampler(dataset, num_replicas=data_world, rank=data_rank,
                                              seed=0))
loader = DataLoader(dataset, batch_size=8, sampler=sampler, generator=torch.Generator())
ckpt = CheckpointManager(args.ckpt, {"model": model, "optim": opt, "sched": sched},
                         rank_state={"sampler": sampler}, every=10, create=True)
start = ckpt.restore()
rec = Recovery.adopt(model, opt, checkpointer=ckpt, samplers=[sampler],             # resilient
                     data_parallel=data_parallel, build=build)                 # resilient


def log(what: dict) -> None:
    if args.state_log and rec.rank == 0:
        with open(os.path.join(args.state_log, "state.log"), "a") as f:
            f.write(json.dumps(what) + "\n")


batches = forever(loader)
start_world = rec.world_size
for step in rec.steps(start, args.steps):                                       # resilient
    with rec.attempt():                                                        # resilient
        if args.state_log:  # the state this step starts from (after a recovery: the restored)
            log({"begin": step, "hash": state_hash(rec, rec.model, opt)})
        if args.lose_device == f"{first_rank}:{step}" and not rec.joined:
            lose_device(rec.device)  # the process leaves; resilient run restarts it alone
        if args.kill == f"{first_rank}:{step}" and not rec.joined:
            os.kill(os.getpid(), signal.SIGKILL)
        xb, yb, index = next(batches)
        opt.zero_grad()
        xb, yb = xb.to(DEVICE), yb.to(DEVICE)
        nn.functional.mse_loss(rec.model(xb), yb).backward()                   # resilient
        opt.step()
        sched.step()
        short = rec.world_size < start_world and args.short_step_sleep is not None
        time.sleep(args.short_step_sleep if short else args.step_sleep)
        # one line per data-parallel rank: a tensor-parallel pair logs its batch once
        if args.sample_log and not (args.tp and rec.world_size == 4 and rec.rank % 2):
            with open(os.path.join(args.sample_log, f"pid{os.getpid()}.samples"), "a") as f:
                f.write(json.dumps([step, os.getpid(), index.tolist()]) + "\n")
        if args.state_log:
            log({"done": step + 1, "hash": state_hash(rec, rec.model, opt)})
if args.state_log:
    with open(os.path.join(args.state_log, f"timeline{rec.rank}.json"), "w") as f:
        f.write(rec.timeline.to_json())
ckpt.close()
dist.destroy_process_group()
