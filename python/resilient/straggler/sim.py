"""A synchronous data-parallel job in miniature, for the tests, the demo and the benchmark.

`run_world` spawns `world` CPU processes (gloo). Each step every rank "computes" (sleeps `base_s`,
the slowed rank `base_s * (1 + slowdown)` in one sleep, so the sleep's fixed overshoot makes the
real slowdown slightly smaller than nominal, never larger) and all-reduces a small tensor inside
monitor.wait(). A StragglerMonitor watches each rank; the results say when the slow rank was first
named and persistent, and how many reports named a rank that was not slowed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

from resilient import settings
from resilient.ports import free_port


@dataclass
class Scenario:
    """One run: `steps` steps, `slow_rank` slowed by `slowdown` (0.2 = 20%) from `slow_from`."""

    name: str
    steps: int
    slow_rank: int | None = None
    slowdown: float = 0.0
    slow_from: int = 0
    base_s: float = 0.002
    interval: int = 10


@dataclass
class ScenarioResult:
    """What rank `rank`'s monitor saw. Steps are 0-based; -1 means never."""

    name: str
    rank: int
    steps: int
    mean_step_ms: float
    first_named_step: int = -1      # monitor.step_index when the slow rank was first reported
    named_phase: str = ""
    named_ratio: float = 0.0
    first_persistent_step: int = -1  # monitor.step_index when the policy hook fired
    since_step: int = -1            # the change point the persistent report gave
    false_reports: int = 0          # reports of a rank that was not slowed (or not yet)
    # Of those, the ones the harness's own timing cannot explain: in every window the report
    # covers (since..last step) the named rank's busy time (step start to the collective) was
    # below min_ratio x the cross-rank median. On a shared host the OS can slow one rank for real;
    # such a report is right, the rest are not.
    unexplained_reports: int = 0
    false_windows: list[list[int]] = field(default_factory=list)  # [rank, since, last_step]
    reports: list[str] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)

    @property
    def detection_latency(self) -> int:
        """Steps from the start of the slowdown to the first report naming it (-1: never)."""
        return -1 if self.first_named_step < 0 else self.first_named_step - self.slow_from

    slow_from: int = 0


def _run_scenario(sc: Scenario, rank: int, world: int, dist, torch) -> ScenarioResult:
    from resilient.straggler import StragglerMonitor, default_options

    opts = default_options()
    opts.interval = sc.interval
    res = ScenarioResult(sc.name, rank, sc.steps, 0.0, slow_from=sc.slow_from)
    mon: StragglerMonitor

    def on_report(report) -> None:
        genuine = report.rank == sc.slow_rank and report.last_step >= sc.slow_from
        if genuine and res.first_named_step < 0:
            res.first_named_step = mon.step_index
            res.named_phase = str(report.phase.name).lower()
            res.named_ratio = report.ratio
        if not genuine:
            res.false_reports += 1
            res.false_windows.append([report.rank, report.since_step, report.last_step])
        if len(res.reports) < 50:
            res.reports.append(str(report))

    def on_persistent(r: int, report) -> None:
        if r == sc.slow_rank and res.first_persistent_step < 0:
            res.first_persistent_step = mon.step_index
            res.since_step = report.since_step

    mon = StragglerMonitor(options=opts, on_report=on_report, on_persistent_straggler=on_persistent,
                           log_rank=None if settings.get("RESILIENT_SIM_LOG") else -1)
    grad = torch.ones(16)
    busy = torch.zeros(sc.steps, dtype=torch.float64)  # the harness's own timing
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(sc.steps):
        b0 = time.perf_counter()
        with mon.step():
            with mon.compute():
                slow = rank == sc.slow_rank and step >= sc.slow_from
                time.sleep(sc.base_s * (1.0 + sc.slowdown) if slow else sc.base_s)
            busy[step] = time.perf_counter() - b0
            with mon.wait():
                dist.all_reduce(grad)
    mon.flush()
    res.mean_step_ms = (time.perf_counter() - t0) / sc.steps * 1e3
    all_busy = [torch.empty_like(busy) for _ in range(world)]
    dist.all_gather(all_busy, busy)
    res.unexplained_reports = sum(
        not _really_slow(all_busy, r, since, last, sc.interval, opts.min_ratio)
        for r, since, last in res.false_windows)
    res.timeline = [asdict(p) for p in mon.timeline]
    return res


def _really_slow(all_busy, rank: int, since: int, last: int, interval: int,
                 min_ratio: float) -> bool:
    """Whether the harness's own timing saw `rank` slow in one of the report's windows (of
    `interval` steps, ending at `last`, back to the report's `since` step; only the last one if
    `since` is unknown): its median busy time >= min_ratio x the ranks' median there."""
    import statistics

    windows = 1 if since < 0 else max(1, -(-(last - since + 1) // interval))
    for k in range(windows):
        end = last - k * interval
        if end < 0:
            break
        first = max(0, end - interval + 1)
        medians = [statistics.median(b[first:end + 1].tolist()) for b in all_busy]
        if medians[rank] >= min_ratio * statistics.median(medians):
            return True
    return False


def _worker(rank: int, world: int, init_method: str, scenarios: list[Scenario],
            out_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = [asdict(_run_scenario(sc, rank, world, dist, torch)) for sc in scenarios]
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def run_world(scenarios: list[Scenario], world: int = 4,
              timeout_s: float = 150.0) -> list[list[ScenarioResult]]:
    """Runs the scenarios in `world` spawned processes; returns results[rank][scenario].

    Raises:
        TimeoutError: the processes did not finish within `timeout_s` (they are killed).
        RuntimeError: a process failed.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="straggler-sim-") as out_dir:
        init = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.start_processes(_worker, args=(world, init, scenarios, out_dir), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"straggler simulation did not finish in {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        out = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                out.append([_result(d) for d in json.load(f)])
        return out


def _result(d: dict) -> ScenarioResult:
    return ScenarioResult(**d)
