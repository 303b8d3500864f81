"""A small local launcher for recovery runs: hosts the job's store (outside the ranks, as
torchrun's agent does), starts one process per rank, and always cleans them up.

Used by ``examples/ddp_recovery.py``, the recovery tests and the benchmarks. Workers get
``--rank R --world W --store HOST:PORT --out DIR`` appended to the command, write
``DIR/rank<R>.json`` when they finish, and may record the time of an injected fault in the store
under ``fault/time`` (``time.monotonic()``; CLOCK_MONOTONIC is shared by the processes of a
host, so the launcher can subtract it from the workers' event times).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilient.recovery.timeline import PHASES, phases


def _die_with_parent() -> None:
    """Child side of spawn: SIGKILL this worker when the launcher dies (Linux prctl), so a
    killed or timed-out launcher never leaves ranks behind."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): a signal other than SIGKILL would wait."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


class LocalJob:
    """``world`` worker processes of ``cmd`` plus the TCPStore they share."""

    def __init__(self, cmd: list[str], world: int, out_dir: str | os.PathLike, *,
                 host: str = "127.0.0.1", env: dict | None = None,
                 store_timeout_s: float = 120.0) -> None:
        import torch.distributed as dist

        self.cmd, self.world, self.host = list(cmd), world, host
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        # A rank that crashes natively says which thread, in its log (RESILIENT_CRASH_HANDLER).
        self.env = {"RESILIENT_CRASH_HANDLER": "1", "PYTHONFAULTHANDLER": "1", **os.environ,
                    **(env or {})}
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=store_timeout_s))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def address(self) -> str:
        """``host:port`` of the store."""
        return f"{self.host}:{self.store.port}"

    def spawn(self, ranks: list[int] | None = None, extra: list[str] | None = None) -> None:
        """Starts the given ranks (default all); their output goes to ``rank<R>.log``."""
        for r in ranks if ranks is not None else range(self.world):
            cmd = self.cmd + ["--rank", str(r), "--world", str(self.world), "--store",
                              self.address, "--out", str(self.out)] + list(extra or [])
            log = open(self.out / f"rank{r}.log", "a")  # noqa: SIM115 -- owned by the child
            self.procs[r] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             env=self.env, start_new_session=True,
                                             preexec_fn=_die_with_parent)
            log.close()

    def wait(self, ranks: list[int], timeout_s: float) -> dict[int, int | None]:
        """Waits until ``ranks`` exit or ``timeout_s``; returns each one's exit code (None if
        still running)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.procs[r].poll() is not None for r in ranks):
                break
            time.sleep(0.05)
        return {r: self.procs[r].poll() for r in ranks}

    def signal(self, rank: int, sig: int) -> None:
        """Sends ``sig`` to a rank's process (no error if it is gone)."""
        p = self.procs.get(rank)
        if p is not None and p.poll() is None:
            os.kill(p.pid, sig)

    def fault_time(self) -> float | None:
        """The ``fault/time`` a worker recorded, if any."""
        if not self.store.check(["fault/time"]):
            return None
        return float(self.store.get("fault/time").decode())

    def report(self, rank: int) -> dict[str, Any] | None:
        """A worker's ``rank<R>.json``, or None."""
        path = self.out / f"rank{rank}.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def log_tail(self, rank: int, n: int = 2000) -> str:
        try:
            return (self.out / f"rank{rank}.log").read_text()[-n:]
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        """SIGKILLs every rank still alive (stopped ones too) with its process group, and reaps
        them. A rank still running gets SIGUSR1 first, so its log shows where it hung (with
        RESILIENT_CRASH_HANDLER, which LocalJob sets, resilient registers faulthandler's dump of
        every Python thread for SIGUSR1)."""
        alive = [p for p in self.procs.values() if p.poll() is None]
        running = [p for p in alive if not _stopped(p.pid)]
        for p in running:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if running:
            time.sleep(0.5)  # the dump is written from the signal handler, at once
        for p in alive:  # the whole group: a rank's own children (loader workers) go too
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except PermissionError:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def summarize(reports: dict[int, dict[str, Any]], t_fault: float | None) -> dict[str, Any]:
    """Phases of the (first) recovery per survivor and the slowest of each, from the fault."""
    per_rank = {}
    for r, rep in sorted(reports.items()):
        events = [e for e in rep.get("timeline", []) if e["kind"] != "fault"]
        per_rank[r] = phases(events, t_fault)
    out: dict[str, Any] = {"per_rank": per_rank}
    for key in [f"{p}_s" for p in PHASES] + ["total_s", "to_restored_s"]:
        vals = [p[key] for p in per_rank.values() if key in p]
        if vals:
            out[key] = max(vals)
    sources = {p.get("source") for p in per_rank.values() if p}
    methods = {p.get("method") for p in per_rank.values() if p}
    out["source"] = ",".join(sorted(s for s in sources if s))
    out["method"] = ",".join(sorted(m for m in methods if m))
    return out


__all__ = ["LocalJob", "summarize"]
