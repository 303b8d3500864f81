"""One rank of an FSDP2 job (CPU, gloo) that replicates its shards to peers, loses rank 3 to
SIGKILL, and restores the lost shard from memory on the survivors' new group (with a spare, or
resharded N -> N-1; hsdp: HSDP over 2 replica groups without peer copies, the lost shard taken
from the other replica group; tp: tensor parallel x FSDP2 on 4 ranks, resharded to FSDP2 on 3).
Run by test_recovery_replica.py; writes <out>/rank<r>.json.

    fsdp_replica_worker.py ROLE RANK PORT OUT SCENARIO     (ROLE: member | spare)

DEVICE=cuda (tests/python/test_gpu_replica.py): NCCL, one GPU per rank (the spare takes the lost
rank's GPU); replicas still travel between host memories over gloo.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resilient.comm.process_group import (
    join_process_group,
    rebuild_process_group,
    verify_group,
)
from resilient.recovery.replica import PeerReplicas, flatten
from resilient.recovery.reshard import ReplicaUnavailable, restore_sharded

WORLD, STEPS, LOST = 4, 5, 3
DEVICE = os.environ.get("DEVICE", "cpu")
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"


class Net(nn.Module):
    def __init__(self, hidden: int = 37) -> None:
        super().__init__()
        # odd sizes: FSDP2's chunks are uneven over 4 and over 3 ranks (tp: a hidden size
        # that the tensor-parallel pairs split evenly, as TP's local outputs need)
        self.layers = nn.ModuleList([nn.Linear(29, hidden), nn.Linear(hidden, 11)])
        self.scale = nn.Parameter(torch.ones(11))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x))) * self.scale


HSDP = False  # scenario "hsdp": 2 replica groups of 2 ranks while the world is 4
TP = False  # scenario "tp": tensor parallel over pairs of ranks, FSDP2 across them (world 4)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The user's factory: the model sharded over the current default group, its optimizer."""
    torch.manual_seed(0)
    model = Net(38 if TP else 37).to(_device())
    world = dist.get_world_size()
    if TP and world == 4:  # layer 0 column-, layer 1 row-parallel; FSDP2 over the other dim
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh2 = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], {"layers.0": ColwiseParallel(),
                                                "layers.1": RowwiseParallel()})
        mesh = mesh2["dp"]
    else:
        mesh = (init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("replicate", "shard"))
                if HSDP and world == 4 else init_device_mesh(DEVICE, (world,)))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else \
        torch.device("cpu")


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    # tensor-parallel peers take the same input
    data_rank = dist.get_rank() // 2 if TP and dist.get_world_size() == 4 else dist.get_rank()
    g = torch.Generator().manual_seed(1000 * step + data_rank)
    loss = model(torch.randn(8, 29, generator=g).to(_device())).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    for group in opt.param_groups:  # a schedule: the rates differ from step to step
        group["lr"] *= 0.9


def _dev_id() -> torch.device | None:
    return _device() if DEVICE == "cuda" else None


def full_hash(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of the full (unsharded) model and optimizer state: equal whatever the sharding."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    tensors, leaves = flatten({"model": msd, "optim": osd})
    h = hashlib.sha256()
    for key, t in sorted(tensors, key=lambda kv: kv[0]):
        h.update(key.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(leaves, sort_keys=True).encode())
    return h.hexdigest()


def main() -> None:
    global LOST, HSDP, TP
    role, rank, port, out, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    if scenario.endswith("1"):  # rank 1 lost: the survivors' ranks move down (2 -> 1, 3 -> 2)
        LOST, scenario = 1, scenario[:-1]
    spare = scenario == "spare"
    HSDP, TP = scenario == "hsdp", scenario == "tp"
    if DEVICE == "cuda":
        torch.cuda.set_device(LOST if role == "spare" else rank)
    new_world = WORLD if spare else WORLD - 1
    result: dict = {"rank": rank, "role": role}
    if role == "spare":
        join_process_group(store, generation=1, rank=WORLD - 1, world_size=new_world,
                           backend=BACKEND, device_id=_dev_id())
        verify_group(device=_device())  # the survivors' rebuild runs it first too
        replicas = None
    else:
        dist.init_process_group(BACKEND, store=dist.PrefixStore("gen0/", store), rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=60),
                                device_id=_dev_id())
        model, opt = build()
        # two emulated hosts: ranks 0, 1 and 2, 3; rank 3's buddy is rank 1, 1's is 3
        # hsdp: no peer copies at all (factor 0): rank 3's shard is rank 1's, its twin in
        # the other replica group
        replicas = PeerReplicas(model, opt, host=f"host{rank // 2}", every=1,
                                factor=0 if HSDP else None)
        result["buddies"] = replicas.to
        hashes = {}
        for step in range(1, STEPS + 1):
            train_step(model, opt, step)
            if not (scenario == "lag" and rank == LOST and step == STEPS):
                replicas.replicate(step)
            hashes[step] = full_hash(model, opt)  # collective
        replicas.drain(STEPS - 1 if scenario == "lag" else STEPS)
        dist.barrier()
        if rank == (1 if LOST == 3 else 3) and scenario.startswith("corrupt"):  # its buddy
            held = replicas._held[LOST]
            for snap in held[-1:] if scenario == "corrupt" else held:
                snap.buf[snap.nbytes // 2] ^= 0xFF  # memory damaged after it was verified
        dist.barrier()
        if rank == LOST:
            os.kill(os.getpid(), signal.SIGKILL)
        rebuild_process_group(store, generation=1, excluded=[LOST], new_size=new_world,
                              backend=BACKEND, device_id=_dev_id())
        result["new_rank"] = dist.get_rank()
        result["old_stats"] = {k: v for k, v in vars(replicas.stats).items()}
    model2, opt2 = build()
    try:
        restored = restore_sharded(model2, opt2, replicas)
    except ReplicaUnavailable as e:
        result["unavailable"] = str(e)
        dist.barrier()
        _finish(out, rank, result)
        return
    result["step"] = restored.step
    result["bytes_received"] = restored.bytes_received
    result["bytes_local"] = restored.bytes_local
    got = full_hash(model2, opt2)
    if role == "member":
        result["match"] = got == hashes[restored.step]
    train_step(model2, opt2, restored.step + 1)  # training goes on in the new group
    result["after"] = full_hash(model2, opt2)
    _finish(out, rank, result)


def _finish(out: str, rank: int, result: dict) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    os._exit(0)  # the failed generation's groups and FSDP modules are not torn down


if __name__ == "__main__":
    main()
