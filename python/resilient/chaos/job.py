"""The built-in chaos job: a small deterministic CPU data-parallel training run (gloo) that
checkpoints with the Checkpointer, watches its peers with the FailureDetector and reports events.

Run by `resilient chaos` when no job command is given (one process per rank, ``python -m
resilient.chaos.job``). It resumes from the newest checkpoint that verifies; when a peer fails it
records a ``detected`` event and exits with EXIT_PEER_FAILED, leaving the restart to the runner
(recovery by restart). Every step is a pure function of (seed, step, rank, world size), so a run
that restarts from a checkpoint ends with the same bits as a fault-free run of the same size.
Environment (set by the runner): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
RESILIENT_CHAOS_STORE (host:port of the runner's TCPStore), RESILIENT_CHAOS_ATTEMPT,
RESILIENT_CHAOS_CKPT_DIR, RESILIENT_EVENTS_DIR.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import sys
import time

EXIT_PEER_FAILED = 75  # EX_TEMPFAIL: a peer failed; restart me
EXIT_NO_CHECKPOINT = 3  # checkpoints exist but none verifies
EXIT_UNHEALTHY = 4  # the GPU health check failed: do not join


def _model_digest(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _batch(seed: int, step: int, rank: int, world: int, per_rank: int, dim: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank * 17 + world)
    x = torch.randn(per_rank, dim, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return x, y


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resilient.chaos.job")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-ms", type=float, default=50.0, help="extra time per step (sleep)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--detector", choices=["on", "off"], default="on")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from resilient.checkpoint import Checkpointer
    from resilient.errors import CorruptCheckpointError
    from resilient.telemetry import events

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("RESILIENT_CHAOS_ATTEMPT", "0"))
    events.emit("start", world_size=world, attempt=attempt)
    torch.set_num_threads(1)
    from resilient.detect import health

    report = health.check()  # before joining (and before every rejoin: each attempt)
    events.emit("health", available=report.available, healthy=report.healthy,
                reason=report.reason, problems=report.problems)
    if not report.healthy:
        msg = f"rank {rank} failed its health check: {'; '.join(report.problems)}"
        events.emit("fatal", message=msg)
        print(msg, file=sys.stderr)
        return EXIT_UNHEALTHY
    metrics = None
    if os.environ.get("RESILIENT_METRICS_PORT"):
        from resilient.telemetry.metrics import RankMetrics

        metrics = RankMetrics(rank)
        metrics.follow_events()
        metrics.serve()
    host, port = os.environ["RESILIENT_CHAOS_STORE"].rsplit(":", 1)
    base = dist.TCPStore(host, int(port), world, is_master=False,
                         timeout=datetime.timedelta(seconds=30))
    store = dist.PrefixStore(f"attempt-{attempt}", base)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    detector = None
    finishing = False
    if args.detector == "on":
        from resilient.detect import FailureDetector

        def on_failure(ranks: list, generation: int) -> None:
            if finishing:
                return  # peers stopping their detectors after the final barrier
            events.emit("detected", ranks=list(ranks), generation=generation, source="detector")
            os._exit(EXIT_PEER_FAILED)

        detector = FailureDetector(base, rank, world, job=f"chaos-{attempt}",
                                   on_failure=on_failure, hang_watchdog=False)
        detector.start()
        if metrics is not None:
            metrics.attach_detector(detector)
    events.emit("init_done", world_size=world)

    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(args.dim, args.hidden), torch.nn.Tanh(),
                              torch.nn.Linear(args.hidden, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = {"model": net, "optim": opt, "meta": {"step": 0}}
    ckpt = Checkpointer(os.environ["RESILIENT_CHAOS_CKPT_DIR"], keep=args.keep, create=True,
                        distributed=False)  # rank 0 saves alone; every rank loads
    t0 = time.time()
    try:
        loaded = ckpt.load(state)
    except CorruptCheckpointError as e:
        msg = f"no valid checkpoint to resume from: {e}"
        events.emit("fatal", message=msg)
        print(f"rank {rank}: {msg}", file=sys.stderr)
        os._exit(EXIT_NO_CHECKPOINT)
    skipped = [[s, why] for s, why in ckpt.last_load.skipped]
    start_step = int(state["meta"]["step"]) if loaded is not None else 0
    events.emit("load", step=loaded, skipped=skipped, seconds=time.time() - t0)
    if rank != 0:
        ckpt.close()
        ckpt = None
    params = list(net.parameters())

    def average_gradients() -> None:
        # Data parallelism with one fixed-layout all_reduce rather than DDP's buckets: DDP
        # re-buckets after its first iteration, which changes how the reduction is chunked, so
        # a run resumed from a checkpoint (a new first iteration) would sum in another order and
        # be bit-exact with a fault-free run only on 2 ranks.
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for q in params:
            n = q.numel()
            q.grad.copy_(flat[offset:offset + n].view_as(q))
            offset += n
    pending = None  # (step, handle, t_begin, stall_s)

    def finish_save(block: bool) -> None:
        nonlocal pending
        if pending is None or (not block and not pending[1].done()):
            return
        step, handle, t_begin, stall = pending
        pending = None
        try:
            handle.wait(60)
            st = handle.stats()
            events.emit("save_end", step=step, ok=True, seconds=time.time() - t_begin,
                        stall_s=stall, durable_s=st.get("durable_s"),
                        bytes=int(st.get("bytes", 0)))
        except (OSError, TimeoutError, RuntimeError) as e:
            events.emit("save_end", step=step, ok=False, error=str(e),
                        seconds=time.time() - t_begin)

    for step in range(start_step, args.steps):
        x, y = _batch(args.seed, step, rank, world, 8, args.dim)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        average_gradients()
        opt.step()
        if args.step_ms > 0:
            time.sleep(args.step_ms / 1000)
        done = step + 1
        state["meta"]["step"] = done
        if detector is not None:
            detector.step(done)
        events.emit("step", step=done)
        if ckpt is not None:
            finish_save(block=False)
            if done % args.ckpt_every == 0 and done < args.steps:
                finish_save(block=True)  # one save in flight at a time
                events.emit("save_begin", step=done)
                try:
                    t_save = time.time()
                    handle = ckpt.save(done, state)
                    stall = time.time() - t_save
                    pending = (done, handle, t_save, stall)
                except OSError as e:
                    events.emit("save_end", step=done, ok=False, error=str(e), seconds=0.0)
    if ckpt is not None:
        finish_save(block=True)
        ckpt.close()
    dist.barrier()
    finishing = True
    events.emit("done", step=args.steps, digest=_model_digest(net), world_size=world)
    if detector is not None:
        detector.stop()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
