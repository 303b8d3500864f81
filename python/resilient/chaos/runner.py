"""Runs one chaos plan: launches the job's ranks, injects the plan's faults when their step or
time comes, and drives recovery by restart (tear the job down, start it again from the last
checkpoint) whenever a rank fails and the job does not recover by itself. Everything that
happened is kept as a timeline of events (the job's own, from RESILIENT_EVENTS_DIR, plus the
runner's) that report.py turns into numbers."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resilient.chaos import faults as fx
from resilient.chaos.plan import RANK_FAULTS, Fault, Plan, RunResult
from resilient.telemetry import events as ev

#: The longest a corrupt fault waits for the save that began last to commit (seconds).
CORRUPT_WAIT_S = 30.0

POLL_S = 0.02


class Runner:
    """Executes `plan` in `run_dir` (a fresh temporary directory by default)."""

    def __init__(self, plan: Plan, run_dir: str | Path | None = None, verbose: bool = False):
        self.plan = plan
        self.dir = Path(run_dir or tempfile.mkdtemp(prefix=f"chaos-{plan.name}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.dir / "ckpt"
        self.events_dir = self.dir / "events"
        self.verbose = verbose
        self.result = RunResult(plan=plan, run_dir=str(self.dir))
        self._pending = sorted(plan.faults, key=lambda f: (f.at_step is None, f.at_step or 0,
                                                           f.at_time or 0))
        self._procs: dict[int, subprocess.Popen] = {}
        self._alive_ranks = list(range(plan.ranks))
        self._slow: list[fx.DutyCycle] = []
        self._timed: list[tuple[float, Any]] = []  # (deadline, undo) for duration faults
        self._file_faults: dict[int, fx.FileFault] = {}
        self._save_kill: list[Fault] = []
        self._disk: fx.SmallDisk | None = None
        self._netns: fx.NetnsPartition | None = None
        self._max_step = 0
        self._saving: int | None = None  # the newest step whose save began (events)
        self._t0 = 0.0

    # ---- timeline ----
    def _note(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "kind": kind, "rank": "runner", **fields}
        self.result.timeline.append(rec)
        if self.verbose:
            print(f"[chaos {rec['t'] - self._t0:7.2f}s] {kind} {fields}", file=sys.stderr)

    # ---- setup ----
    def _prepare(self) -> str | None:
        """Sets up what the plan's faults need; returns a reason to skip the run, or None."""
        types = {f.type for f in self.plan.faults}
        if "enospc" in types:
            why = fx.SmallDisk.unavailable()
            if why:
                return why
            self._disk = fx.SmallDisk(self.ckpt)
            self._disk.mount()
        if "partition" in types:
            why = fx.NetnsPartition.unavailable()
            if why:
                return why
            self._netns = fx.NetnsPartition(f"{os.getpid() % 100000}")
            self._netns.setup()
        for f in self.plan.faults:
            if f.type == "eio":
                self._file_faults[f.rank] = fx.FileFault(self.dir / f"eio-{f.rank}", self.ckpt,
                                                         "write,fsync", "EIO")
            elif f.type == "kill_during_save":
                self._file_faults[f.rank] = fx.FileFault(self.dir / f"slow-{f.rank}", self.ckpt,
                                                         "write,fsync", "0", delay_ms=150)
        self.ckpt.mkdir(parents=True, exist_ok=True)
        return None

    def _command(self) -> list[str]:
        if self.plan.command:
            return list(self.plan.command)
        p = self.plan
        return [sys.executable, "-m", "resilient.chaos.job", "--steps", str(p.steps),
                "--ckpt-every", str(p.ckpt_every), "--keep", str(p.keep), "--seed", str(p.seed),
                "--step-ms", str(p.step_ms)]

    def _launch(self, attempt: int, store: Any) -> None:
        world = len(self._alive_ranks)
        host = self._netns.host_ip if self._netns else "127.0.0.1"
        for new_rank, old_rank in enumerate(self._alive_ranks):
            env = dict(os.environ, RANK=str(new_rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(new_rank), MASTER_ADDR=host,
                       MASTER_PORT=str(store.port + 1 + attempt),
                       RESILIENT_CHAOS_STORE=f"{host}:{store.port}",
                       RESILIENT_CHAOS_ATTEMPT=str(attempt),
                       RESILIENT_CHAOS_CKPT_DIR=str(self.ckpt),
                       RESILIENT_EVENTS_DIR=str(self.events_dir),
                       RESILIENT_EVENTS_RANK=str(old_rank),
                       RESILIENT_LOG_LEVEL=os.environ.get("RESILIENT_LOG_LEVEL", "error"),
                       # a rank that crashes natively says which thread, in its log
                       RESILIENT_CRASH_HANDLER=os.environ.get("RESILIENT_CRASH_HANDLER", "1"))
            prefix: list[str] = []
            if self._netns:
                in_ns = old_rank == self._partition_rank()
                env["GLOO_SOCKET_IFNAME"] = self._netns.vn if in_ns else self._netns.vh
                env["RESILIENT_DETECT_HOST"] = self._netns.ns_ip if in_ns else self._netns.host_ip
                prefix = self._netns.prefix() if in_ns else []
            if old_rank in self._file_faults:
                env.update(self._file_faults[old_rank].env)
            log = open(self.dir / f"rank-{old_rank}.attempt-{attempt}.log", "w")  # noqa: SIM115
            self._procs[old_rank] = subprocess.Popen(
                prefix + self._command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
            log.close()
        self._note("launch", attempt=attempt, world_size=world, ranks=list(self._alive_ranks))

    def _partition_rank(self) -> int | None:
        return next((f.rank for f in self.plan.faults if f.type == "partition"), None)

    # ---- faults ----
    def _due(self, f: Fault) -> bool:
        if f.at_step is not None:
            return self._max_step >= f.at_step
        return time.time() - self._t0 >= (f.at_time or 0.0)

    def _inject(self, f: Fault) -> None:
        proc = self._procs.get(f.rank)
        pid = proc.pid if proc is not None else None
        if f.type in RANK_FAULTS + ("slow",) and (proc is None or proc.poll() is not None):
            self._note("fault_missed", fault=f.type, target=f.rank, describe=f.describe(),
                       why="the rank had already exited")
            return
        info: dict[str, Any] = {"fault": f.type, "target": f.rank, "step": self._max_step,
                                "describe": f.describe()}
        now = time.monotonic()
        if f.type == "kill" and pid:
            fx.signal_group(pid, signal.SIGKILL)
            if f.permanent:
                self._alive_ranks.remove(f.rank)
        elif f.type == "stop" and pid:
            fx.signal_group(pid, signal.SIGSTOP)
        elif f.type == "slow" and pid:
            self._slow.append(fx.DutyCycle(pid, f.stop_ms, f.run_ms, f.duration))
        elif f.type == "partition" and self._netns:
            self._netns.cut()
        elif f.type == "enospc" and self._disk:
            info["filled_bytes"] = self._disk.fill()
            self._timed.append((now + f.duration, self._disk.free))
        elif f.type == "eio":
            self._file_faults[f.rank].arm()
            self._timed.append((now + f.duration, self._file_faults[f.rank].disarm))
        elif f.type == "corrupt":
            # The newest checkpoint is the one whose save began last: wait (bounded) for its
            # commit, else a save still in flight commits intact after the damage was done
            # to an older step, or to none (a loaded machine's race, seen in CI).
            deadline = time.monotonic() + CORRUPT_WAIT_S
            while (self._saving is not None and time.monotonic() < deadline
                   and max((s for s, _ in fx.step_dirs(self.ckpt)), default=-1) < self._saving):
                time.sleep(0.01)
            info["corrupted_step"] = fx.corrupt_newest(self.ckpt)
            if info["corrupted_step"] is not None:
                self.result.corrupted.append(info["corrupted_step"])
        elif f.type == "kill_during_save":
            self._file_faults[f.rank].arm()  # slow its writes; kill at its next save_begin
            self._save_kill.append(f)
            return  # the injection is noted when the kill happens
        self._note("fault", **info)

    def _on_event(self, e: dict[str, Any]) -> None:
        if e["kind"] == "step":
            self._max_step = max(self._max_step, int(e.get("step", 0)))
        if e["kind"] == "save_begin" and e.get("step") is not None:
            self._saving = max(self._saving or 0, int(e["step"]))
        if e["kind"] == "save_begin":
            for f in list(self._save_kill):
                if e.get("rank") == f.rank and f.rank in self._procs:
                    time.sleep(0.05)  # inside the (slowed) persist
                    fx.signal_group(self._procs[f.rank].pid, signal.SIGKILL)
                    self._file_faults[f.rank].disarm()
                    self._save_kill.remove(f)
                    self._note("fault", fault=f.type, target=f.rank, step=e.get("step"),
                               describe=f.describe(), saving_step=e.get("step"))

    def _run_timed(self, final: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for deadline, undo in self._timed:
            if final or now >= deadline:
                undo()
            else:
                keep.append((deadline, undo))
        self._timed = keep

    # ---- teardown ----
    def _teardown(self) -> None:
        for slow in self._slow:
            slow.stop()
        self._slow.clear()
        for p in self._procs.values():
            if p.poll() is None:
                fx.signal_group(p.pid, signal.SIGKILL)
                fx.signal_group(p.pid, signal.SIGCONT)
        for p in self._procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self._netns:
            self._netns.heal()

    def _cleanup(self) -> None:
        self._teardown()
        self._run_timed(final=True)
        for ff in self._file_faults.values():
            ff.disarm()
        if self._disk:
            self._disk.free()
        self._record_checkpoints()
        if self._disk:
            self._disk.unmount()
        if self._netns:
            self._netns.teardown()

    def _record_checkpoints(self) -> None:
        self.result.committed_at_end = [s for s, _ in fx.step_dirs(self.ckpt)]
        try:
            from resilient.checkpoint import Checkpointer
            from resilient.errors import CorruptCheckpointError
        except ImportError:
            return
        with Checkpointer(self.ckpt, keep=0, tiers=[]) as ck:
            for s in ck.steps():
                try:
                    ck.verify(s)
                    self.result.verified.append(s)
                except (CorruptCheckpointError, OSError):
                    pass

    # ---- main loop ----
    def run(self) -> RunResult:
        import torch.distributed as dist

        self._t0 = time.time()
        self._note("run_start", plan=self.plan.name)
        why = None
        try:
            why = self._prepare()
        except (OSError, subprocess.SubprocessError) as e:
            why = f"setup failed: {e}"
        if why:
            self.result.outcome, self.result.message = "skipped", why
            self._cleanup()
            return self.result
        host = self._netns.host_ip if self._netns else "127.0.0.1"
        store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        tail = ev.Tail(self.events_dir)
        attempt = 0
        try:
            self._launch(attempt, store)
            deadline = self._t0 + self.plan.timeout
            last_progress = time.time()
            while True:
                time.sleep(POLL_S)
                for e in tail.poll():
                    self.result.timeline.append(e)
                    if e["kind"] == "step":
                        last_progress = time.time()
                    self._on_event(e)
                while self._pending and self._due(self._pending[0]):
                    self._inject(self._pending.pop(0))
                self._run_timed()
                codes = {r: p.poll() for r, p in self._procs.items()}
                if all(c == 0 for c in codes.values()):
                    self.result.outcome = "finished"
                    break
                failed = {r: c for r, c in codes.items() if c not in (None, 0)}
                detected = any(e["kind"] == "detected" for e in self.result.timeline
                               if e.get("t", 0) > self._attempt_t0())
                hung = time.time() - last_progress > self.plan.hang_timeout
                if time.time() > deadline:
                    self.result.outcome, self.result.message = "timeout", "run timed out"
                    break
                if not failed and not hung:
                    continue
                source = "runner:exit" if failed else "runner:progress"
                self._note("runner_detected", source=source, exits=failed,
                           detected_by_job=detected)
                fatal = [e for e in self.result.timeline if e["kind"] == "fatal"
                         and e.get("t", 0) > self._attempt_t0()]
                self._teardown()
                self._note("teardown_done")
                if fatal:
                    self.result.outcome = "unrecoverable"
                    self.result.message = str(fatal[0].get("message"))
                    break
                if len(self._alive_ranks) < self.plan.min_world_size:
                    self.result.outcome = "unrecoverable"
                    self.result.message = (
                        f"{len(self._alive_ranks)} rank(s) left, fewer than the minimum world "
                        f"size {self.plan.min_world_size}: cannot restart")
                    break
                if attempt >= self.plan.max_restarts:
                    self.result.outcome = "unrecoverable"
                    self.result.message = f"gave up after {attempt} restarts"
                    break
                attempt += 1
                self._launch(attempt, store)
                last_progress = time.time()
        finally:
            self.result.attempts = attempt + 1
            self.result.final_world = len(self._alive_ranks)
            self._cleanup()
            for e in tail.poll():
                self.result.timeline.append(e)
            self.result.timeline.sort(key=lambda e: e.get("t", 0.0))
            del store
        self._note("run_end", outcome=self.result.outcome)
        return self.result

    def _attempt_t0(self) -> float:
        launches = [e["t"] for e in self.result.timeline if e["kind"] == "launch"]
        return launches[-1] if launches else 0.0


def run_plan(plan: Plan, run_dir: str | Path | None = None, verbose: bool = False) -> RunResult:
    """Runs one plan (see Runner; plans with an adapter run through resilient.chaos.adapters)."""
    if plan.adapter == "ddp_recovery":
        from resilient.chaos.adapters import run_ddp_recovery

        return run_ddp_recovery(plan, run_dir)
    if plan.adapter:
        raise ValueError(f"unknown adapter {plan.adapter!r}")
    return Runner(plan, run_dir, verbose).run()


def reference_plan(plan: Plan) -> Plan:
    """The same job without faults, on the world size the faulty run ends with."""
    import copy

    ref = copy.deepcopy(plan)
    ref.name = f"{plan.name}-reference"
    ref.faults = []
    ref.ranks = plan.ranks - sum(1 for f in plan.faults if f.type == "kill" and f.permanent)
    return ref


__all__ = ["RANK_FAULTS", "RunResult", "Runner", "reference_plan", "run_plan"]
