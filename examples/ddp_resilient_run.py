"""An ordinary torchrun DDP script made recoverable with a few lines: Recovery adopts the default
group, the store and the DDP model; ``resilient run`` keeps the survivors alive when a rank dies.

    resilient run --standalone --nproc-per-node 4 examples/ddp_resilient_run.py --steps 40
    python -m resilient.run --standalone --nproc-per-node 4 examples/ddp_resilient_run.py
    srun -n 4 python examples/ddp_resilient_run.py   # RESILIENT_STORE=host:port: external store

The lines marked ``# resilient`` are all that differs from the plain DDP script. Kill a rank
(``kill -9``, or ``--kill-rank 1 --kill-step 10``) and the other ranks finish the run with the
global batch kept (gradient accumulation), ending with the parameters of the failure-free run.
``--user-loop`` writes the loop out (``for step in rec.steps(0, n): with rec.attempt(): ...``)
instead of handing a loss function to ``rec.run``; ``--loader`` (with ``--user-loop``) draws the
micro-batches from a DataLoader over a DistributedSampler, which Recovery rewinds and re-splits
on a world change, and logs the sample indices of every completed step to
``DIR/rank<R>.samples``. With ``--out DIR`` each rank writes
``DIR/rank<R>.json`` (step, world, parameters, timeline),
``DIR/rank<R>.pid`` and ``DIR/rank<R>.step`` (the step it is running). ``resilient run
--replacements 1`` starts a new rank for a lost one; it joins at a step boundary and receives the
state from a live peer. ``--fsdp`` shards the model with FSDP2 (``fully_shard``) instead of
DDP: Recovery rebuilds it on the new group with ``build`` and restores the shards from peers'
host memory (docs/recovery.md, "Sharded models"); the report then has no parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient import ResumableSampler, forever  # resilient (--loader)
from resilient.recovery import Recovery, RecoveryStopped, joining  # resilient
from resilient.recovery.environment import init_env  # resilient

FEATURES, HIDDEN = 32, 64


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 1))


def make_data(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: the same on every rank whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, FEATURES, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(global_batch, 1, generator=g)
    return x, y


def make_dataset(samples: int) -> TensorDataset:
    """--loader: (x, y, index) samples."""
    x, y = make_data(-1, samples)
    return TensorDataset(x, y, torch.arange(samples))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (demos)")
    p.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself ...")
    p.add_argument("--kill-step", type=int, default=-1, help="... at the start of this step")
    p.add_argument("--fault", default="kill", choices=("kill", "device"),
                   help="what happens to --kill-rank: SIGKILL, or its device fails (a real "
                        "device-side assert on CUDA, emulated on CPU)")
    p.add_argument("--out", default="", help="directory for per-rank reports")
    p.add_argument("--wait-for-joiner", type=int, default=-1,
                   help="test hook: at this step the members wait (up to 60 s) until a "
                        "replacement rank asked to join, so that it is admitted before the end")
    p.add_argument("--user-loop", action="store_true",
                   help="the loop written out (rec.steps / rec.attempt) instead of rec.run")
    p.add_argument("--loader", action="store_true",
                   help="with --user-loop: micro-batches from a DataLoader + DistributedSampler")
    p.add_argument("--samples", type=int, default=240, help="--loader: samples per epoch")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: NCCL, rank on GPU LOCAL_RANK %% device count (a spare of "
                        "`resilient run --spares` shares a GPU until a rank there is lost)")
    p.add_argument("--init-method", default="env://",
                   help="e.g. etcd://h1:2379,h2:2379/job42/ (the job's store on etcd: no rank "
                        "hosts it; RANK and WORLD_SIZE from the environment)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 (fully_shard over the default group) instead of DDP")
    p.add_argument("--hsdp", action="store_true",
                   help="with --fsdp: HSDP over 2 replica groups while the world is even and "
                        ">= 4 (a world of 3 after a loss shards over all 3)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="etcd:// only: seconds; bounds the group's collectives and every store "
                        "call (a rank cut off from the store's quorum stops after about twice "
                        "this)")
    return p.parse_args(argv)


def progress(a: argparse.Namespace, rec: Recovery) -> None:
    """Fault hook at each step start: report the step, kill this rank if asked."""
    if a.out:
        name = os.path.join(a.out, f"rank{rec.initial_rank}")
        if not os.path.exists(name + ".pid"):
            with open(name + ".pid", "w") as f:
                f.write(str(os.getpid()))
        with open(name + ".step", "w") as f:
            f.write(str(rec.step))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rec.initial_rank == a.kill_rank and rec.step == a.kill_step and first_attempt:
        if a.out:  # the fault's time, on the clock of the timeline's time_mono
            with open(os.path.join(a.out, f"rank{rec.initial_rank}.killed"), "w") as f:
                f.write(repr(time.monotonic()))
        if a.fault == "device":
            from resilient.chaos.faults import lose_device

            lose_device(rec.device)  # this process leaves; resilient run restarts it alone
        os.kill(os.getpid(), signal.SIGKILL)
    if rec.step == a.wait_for_joiner and not rec.joined:
        from resilient.recovery.join import tickets_taken

        deadline = time.monotonic() + 60
        with rec.detector.section("recovery"):  # waiting is not a training hang
            while tickets_taken(rec) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
    if a.step_sleep:
        time.sleep(a.step_sleep)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    torch.set_num_threads(1)
    init_env()  # resilient: RANK, MASTER_ADDR... from SLURM_* under srun (else nothing)
    if a.init_method.startswith(("etcd://", "etcds://")):
        from datetime import timedelta

        import resilient.etcd  # noqa: F401 -- registers the etcd:// rendezvous

        dist.init_process_group("gloo", init_method=a.init_method,
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=a.timeout))  # and every store call
    elif a.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                           % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=a.init_method, device_id=dev)
    else:
        dist.init_process_group("gloo", init_method=a.init_method)
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else (
        torch.device("cpu"))
    def build(on: torch.device = device) -> torch.nn.Module:  # --fsdp: sharded over the group
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with on:
            m = make_model()
        world = dist.get_world_size()
        if a.hsdp and world >= 4 and world % 2 == 0:
            mesh = init_device_mesh(device.type, (2, world // 2),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (world,))
        return fully_shard(m, mesh=mesh)

    # --fsdp: a spare's or replacement's first model holds nothing (its state comes when it
    # joins, and build() is called again then)
    model = build(torch.device("meta") if joining() else device) if a.fsdp else DDP(  # resilient
        make_model().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    sampler = None
    if a.loader:
        data = make_dataset(a.samples)
        sampler = ResumableSampler(DistributedSampler(data, seed=0))  # resilient (--loader)
        batches = forever(DataLoader(data, batch_size=a.micro_batch, sampler=sampler))
    rec = Recovery.adopt(model, opt, global_batch=a.global_batch,  # resilient
                         micro_batch=a.micro_batch,  # resilient
                         samplers=[sampler] if sampler else None,  # resilient (--loader)
                         build=build if a.fsdp else None)  # resilient (--fsdp)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    rec.fault_hooks["step_start"].append(lambda r: progress(a, r))

    def loss_fn(step: int, mb: Any) -> torch.Tensor:  # mb: this rank's slice of the step
        x, y = make_data(step, a.global_batch)
        return torch.nn.functional.mse_loss(rec.model(x[mb.slice].to(device)),
                                            y[mb.slice].to(device))

    code = 0
    report: dict[str, Any] = {}
    try:
        with rec:  # resilient
            if not a.user_loop:
                rec.run(loss_fn, start=0, end=a.steps)  # resilient
            for step in rec.steps(0, a.steps) if a.user_loop else ():  # resilient
                seen: list[int] = []
                with rec.attempt():  # resilient: a peer's failure -> recover, redo the step
                    opt.zero_grad()
                    if not a.loader:
                        x, y = make_data(step, a.global_batch)
                    for mb in rec.micro_batches():  # this rank's share, accumulated
                        if a.loader:
                            xb, yb, index = next(batches)
                            seen += index.tolist()
                        else:
                            xb, yb = x[mb.slice], y[mb.slice]
                        loss = torch.nn.functional.mse_loss(rec.model(xb.to(device)),
                                                            yb.to(device))
                        (loss * mb.loss_scale).backward()
                    opt.step()
                if a.loader and a.out and rec.step > step:  # the step completed
                    with open(os.path.join(a.out, f"rank{rec.initial_rank}.samples"), "a") as f:
                        f.write(json.dumps([step, seen]) + "\n")
    except RecoveryStopped as e:
        print(f"rank {rec.initial_rank}: training stopped: {e}", file=sys.stderr, flush=True)
        report["stopped"], code = str(e), RecoveryStopped.exit_code
    rank = rec.initial_rank  # a replacement rank's id: resilient.recovery.join.JOIN_BASE + n
    if a.out:
        report.update(rank=rank, joined=rec.joined, step=rec.step, world_size=rec.world_size,
                      members=rec.members, timeline=rec.timeline.events)
        if "stopped" not in report:  # FSDP2: gathered from the shards (every rank is here)
            report["params"] = torch.cat([
                (p.full_tensor() if a.fsdp else p).detach().flatten().cpu()
                for p in rec.module.parameters()]).tolist()
        path = os.path.join(a.out, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)
    print(f"rank {rank}: {rec.step} steps, world {rec.world_size}", flush=True)
    sys.stdout.flush()
    # Skip destructors: a failed gloo group's threads may still wait for the dead rank.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
