"""DDP training that survives a killed or frozen rank without restarting (resilient.recovery).

    python examples/ddp_recovery.py --world 4 --steps 30 --kill-rank 1 --kill-step 10
    python examples/ddp_recovery.py --world 4 --steps 30 --stop-rank 2 --stop-step 10
    python examples/ddp_recovery.py --backend nccl --world 4 ...   # one GPU per rank

Without ``--worker`` this script is its own launcher: it hosts the store, starts ``--world``
workers (this script with ``--worker``), waits for the survivors, checks that they end with
identical parameters and prints the recovery timeline (a table, then one JSON line). A worker
kills (SIGKILL) or freezes (SIGSTOP) itself at the start of the given step; the launcher kills a
frozen worker at the end. Exit code 0 on success, 3 when the survivors stopped because fewer
than ``--min-world`` ranks remained, 1 otherwise.

``--mode restart`` / ``--mode resume`` are the restart path the benchmark compares against:
train with checkpoints, die; then new processes import torch, join, load the checkpoint and
all-reduce once (see benchmarks/recovery_bench.py).
"""

from __future__ import annotations

import time

T_PROCESS = time.monotonic()  # before importing torch: the restart path pays for that import

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

FEATURES, HIDDEN = 32, 64


def make_data(step: int, global_batch: int) -> tuple[Any, Any]:
    """The step's global batch: the same on every rank whatever the world size."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, FEATURES, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(global_batch, 1, generator=g)
    return x, y


def make_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 1))


def params_digest(module: Any) -> str:
    """SHA-256 of the parameters' bytes (equal digests: identical replicas)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def connect(address: str) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))


def write_report(a: argparse.Namespace, report: dict) -> None:
    path = os.path.join(a.out, f"rank{a.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def inject_fault(a: argparse.Namespace, store: Any, rec: Any) -> None:
    """Fault hook at each step start: this rank kills or freezes itself at the chosen step."""
    for rank, step, sig, kind in ((a.kill_rank, a.kill_step, signal.SIGKILL, "kill"),
                                  (a.stop_rank, a.stop_step, signal.SIGSTOP, "stop")):
        if rank == rec.initial_rank and step == rec.step:
            store.set("fault/kind", kind)
            store.set("fault/time", repr(time.monotonic()))
            os.kill(os.getpid(), sig)


def hold_for_spares(a: argparse.Namespace, rec: Any) -> None:
    """Members check for joiners only when the step counter is a multiple of --join-step, and
    before the step that reaches --join-step they wait (bounded) until the --spares joiners
    asked to join: the spares are admitted exactly when --join-step steps are done, whatever
    their start-up time."""
    from resilient.recovery.join import tickets_taken

    if a.spares and rec.step == a.join_step - 1 and rec.initial_rank < a.world:
        deadline = time.monotonic() + 120
        with rec.detector.section("recovery"):  # waiting is not a training hang
            while tickets_taken(rec) < a.spares and time.monotonic() < deadline:
                time.sleep(0.05)


def skew_state(a: argparse.Namespace, rec: Any) -> None:
    """Test hook (--skew-rank): before the restore, this survivor pretends its all-reduce
    finished before the peer died: one step ahead, with different parameters."""
    import torch

    if rec.initial_rank == a.skew_rank and rec.recoveries == 1:
        rec.step += 1
        with torch.no_grad():
            for p in rec.module.parameters():
                p.add_(0.01)


def worker(a: argparse.Namespace) -> int:
    import torch

    from resilient.recovery import RecoveryConfig, RecoveryStopped

    torch.set_num_threads(1)
    store = connect(a.store)
    if a.mode == "resume":
        return resume_worker(a, store)
    from resilient.recovery import Recovery

    device = torch.device("cpu")
    if a.backend == "nccl":
        device = torch.device("cuda", a.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    cfg = RecoveryConfig.from_env(policy=a.policy, min_world=a.min_world,
                                  mismatch_source=a.mismatch_source,
                                  join_check_every=a.join_step if a.spares else 0)
    ckpt = None
    if a.checkpoint_dir:
        from resilient import Checkpointer

        # every rank holds one (rank 0 saves): writer=False, the lock goes to the saver
        ckpt = Checkpointer(a.checkpoint_dir, keep=2, create=True, distributed=False,
                            writer=False)
    rec = Recovery(store, a.rank, a.world, model, opt, global_batch=a.global_batch,
                   micro_batch=a.micro_batch, backend=a.backend, config=cfg, checkpointer=ckpt,
                   checkpoint_every=a.checkpoint_every, job=f"ddp-recovery-{a.store}",
                   detector_options={"heartbeat_interval_s": a.heartbeat})
    rec.fault_hooks["step_start"].append(lambda r: inject_fault(a, store, r))
    rec.fault_hooks["before_restore"].append(lambda r: skew_state(a, r))
    rec.fault_hooks["step_start"].append(lambda r: hold_for_spares(a, r))
    loss_fn = torch.nn.functional.mse_loss
    losses: list[float] = []

    def step_loss(step: int, mb: Any) -> Any:
        x, y = make_data(step, a.global_batch)
        loss = loss_fn(rec.model(x[mb.slice].to(device)), y[mb.slice].to(device))
        if mb.index == 0:
            losses.append(float(loss.detach()))
        return loss

    report: dict[str, Any] = {"rank": a.rank}
    code = 0
    try:
        rec.start(join=a.join)
        try:
            rec.run(step_loss, None if a.join else 0, a.steps)
        finally:
            rec.close()
    except RecoveryStopped as e:
        print(f"rank {a.rank}: training stopped: {e}", file=sys.stderr, flush=True)
        report["stopped"] = str(e)
        code = RecoveryStopped.exit_code
    report.update(step=rec.step, final_rank=rec.rank, world_size=rec.world_size,
                  members=rec.members, params_sha256=params_digest(rec.module),
                  params=torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
                  .tolist(),
                  last_loss=losses[-1] if losses else None, accum_steps=rec.plan.accum_steps,
                  lr=opt.param_groups[0]["lr"], timeline=rec.timeline.events,
                  recoveries=rec.timeline.recoveries())
    write_report(a, report)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip destructors: a failed gloo group's threads may still wait for the dead rank.
    os._exit(code)


def resume_worker(a: argparse.Namespace, store: Any) -> int:
    """Restart path: a fresh process joins a new group, loads the checkpoint, all-reduces once."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from resilient import Checkpointer
    from resilient.comm.process_group import join_process_group

    t_import = time.monotonic()
    device = torch.device("cpu")
    if a.backend == "nccl":
        device = torch.device("cuda", a.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    join_process_group(store, generation=a.restart_generation, rank=a.rank, world_size=a.world,
                       backend=a.backend, timeout=timedelta(seconds=60),
                       device_id=device if device.type == "cuda" else None)
    t_init = time.monotonic()
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    t_built = time.monotonic()  # the first optimizer imports torch._dynamo (~1 s here)
    step = Checkpointer(a.checkpoint_dir, distributed=False).load(
        {"model": model, "optimizer": opt, "extra": {}})
    t_loaded = time.monotonic()
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    float(x.item())
    t_first = time.monotonic()
    write_report(a, {"rank": a.rank, "step": step, "t_process": T_PROCESS, "t_import": t_import,
                     "t_init": t_init, "t_built": t_built, "t_loaded": t_loaded,
                     "t_first_collective": t_first})
    os._exit(0)


def launch(a: argparse.Namespace) -> int:
    from resilient.recovery.launch import LocalJob, summarize

    out = a.out or os.path.join("build", "ddp_recovery")
    for name in os.listdir(out) if os.path.isdir(out) else []:
        if name.startswith("rank"):
            os.remove(os.path.join(out, name))
    faulted = {r for r in (a.kill_rank, a.stop_rank) if r >= 0}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + worker_args(a)
    with LocalJob(cmd, a.world, out) as job:
        job.spawn()
        spares = list(range(a.world, a.world + a.spares))
        job.spawn(spares, ["--join"])
        live = [r for r in range(a.world) if r not in faulted] + spares
        codes = job.wait(live, a.timeout)
        t_fault = job.fault_time()
        reports = {r: job.report(r) for r in live}
        for r in live:
            if codes[r] is None or reports[r] is None:
                print(f"rank {r} did not finish (exit {codes[r]}):\n{job.log_tail(r)}",
                      file=sys.stderr)
    missing = [r for r in live if reports[r] is None]
    if missing:
        return 1
    summary = summarize({r: rep for r, rep in reports.items() if rep}, t_fault)
    digests = {rep["params_sha256"] for rep in reports.values()}
    stopped = [r for r, rep in reports.items() if rep.get("stopped")]
    result = {"world": a.world, "backend": a.backend, "kill_rank": a.kill_rank,
              "stop_rank": a.stop_rank, "survivors": live, "exit_codes": codes,
              "steps": {r: rep["step"] for r, rep in reports.items()},
              "params_equal": len(digests) == 1, "stopped": bool(stopped), **summary,
              "timelines": {r: rep["timeline"] for r, rep in reports.items()}}
    print_table(result, t_fault)
    print(json.dumps(result))
    if stopped:
        print(f"stopped: {reports[stopped[0]]['stopped']}", file=sys.stderr)
        return 3
    return 0 if result["params_equal"] and all(c == 0 for c in codes.values()) else 1


def print_table(result: dict, t_fault: float | None) -> None:
    print(f"survivors {result['survivors']} finished steps {result['steps']}; "
          f"identical parameters: {result['params_equal']}")
    for r, events in result["timelines"].items():
        t0 = t_fault if t_fault is not None else (events[0]["time_mono"] if events else 0.0)
        for e in events:
            if e["kind"] in ("started", "fault"):
                continue
            extra = {k: v for k, v in e.items()
                     if k not in ("kind", "rank", "time_mono", "time_wall", "timeline")}
            print(f"  rank {r} {e['time_mono'] - t0:+9.3f}s {e['kind']:<17} {extra}")
    keys = ("detection_s", "agreement_s", "rebuild_s", "restore_s", "first_collective_s",
            "total_s")
    print("  slowest survivor: " + ", ".join(
        f"{k}={result[k]:.3f}" for k in keys if isinstance(result.get(k), float)))


def worker_args(a: argparse.Namespace) -> list[str]:
    keys = ("steps", "kill_rank", "kill_step", "stop_rank", "stop_step", "min_world", "policy",
            "backend", "global_batch", "micro_batch", "lr", "checkpoint_dir",
            "checkpoint_every", "heartbeat", "mode", "restart_generation", "skew_rank",
            "mismatch_source", "spares", "join_step")
    args = []
    for k in keys:
        v = getattr(a, k)
        if v is not None and v != "":
            args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="run as one rank (set by the launcher)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--store", default="")
    p.add_argument("--out", default="")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--stop-rank", type=int, default=-1, help="SIGSTOP this rank (frozen)")
    p.add_argument("--stop-step", type=int, default=-1)
    p.add_argument("--min-world", type=int, default=1)
    p.add_argument("--policy", default="keep_batch", choices=("keep_batch", "scale_lr", "none"))
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint-dir", default="")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--heartbeat", type=float, default=0.1, help="detector heartbeat seconds")
    p.add_argument("--mode", default="recover", choices=("recover", "resume"))
    p.add_argument("--restart-generation", type=int, default=1)
    p.add_argument("--skew-rank", type=int, default=-1,
                   help="test hook: this survivor is one step ahead at the restore")
    p.add_argument("--spares", type=int, default=0,
                   help="start this many extra ranks that join the running job")
    p.add_argument("--join-step", type=int, default=1,
                   help="the spares are admitted when this many steps are done (>= 1)")
    p.add_argument("--join", action="store_true", help="worker: join as a spare (launcher sets)")
    p.add_argument("--mismatch-source", default="storage", choices=("storage", "peer"))
    p.add_argument("--timeout", type=float, default=120.0, help="launcher: seconds to wait")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    return worker(a) if a.worker else launch(a)


if __name__ == "__main__":
    sys.exit(main())
