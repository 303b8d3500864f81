"""Jobs that inject their own faults and recover in place, run under `resilient chaos`.

``ddp_recovery``: examples/ddp_recovery.py (resilient.recovery's in-process recovery loop) is its
own launcher; the plan's one kill or stop fault becomes its --kill-rank/--kill-step (or
--stop-*) flags and the JSON line it prints at the end is turned into this package's events
(fault, detected, recovery_phase, recovery_end, done), so report.analyze() measures the
in-job path the same way as the restart path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from resilient.chaos.plan import Plan, RunResult

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "ddp_recovery.py"
_PHASE_EVENTS = (("agreed", "agreement"), ("rebuilt", "rebuild"), ("restored", "restore"))


def available() -> str | None:
    """None when the in-job recovery example can run, else why not."""
    if not EXAMPLE.exists():
        return f"{EXAMPLE} not found (the recovery loop is not in this checkout)"
    return None


def command(plan: Plan, out: Path) -> list[str]:
    if len(plan.faults) != 1 or plan.faults[0].type not in ("kill", "stop"):
        raise ValueError("the ddp_recovery adapter takes exactly one kill or stop fault")
    f = plan.faults[0]
    if f.at_step is None:
        raise ValueError("the ddp_recovery adapter needs at_step")
    return [sys.executable, str(EXAMPLE), "--world", str(plan.ranks), "--steps", str(plan.steps),
            f"--{f.type}-rank", str(f.rank), f"--{f.type}-step", str(f.at_step),
            "--min-world", str(plan.min_world_size), "--out", str(out),
            "--timeout", str(int(plan.timeout))]


def to_events(result: dict[str, Any], t_launch: float, t_end: float) -> list[dict[str, Any]]:
    """Our events from the example's final JSON: the slowest survivor's recovery."""
    per_rank = result.get("per_rank", {})
    timelines = result.get("timelines", {})
    out = [{"t": t_launch, "kind": "launch", "rank": "runner", "attempt": 0}]
    if not per_rank:
        return out
    slow = max(per_rank, key=lambda r: per_rank[r].get("total_s", 0.0))
    tl = {e["kind"]: e for e in reversed(timelines.get(str(slow), timelines.get(slow, [])))}
    observed = tl.get("failure_observed")
    fault_kind = "kill" if result.get("kill_rank", -1) >= 0 else "stop"
    target = result.get("kill_rank") if fault_kind == "kill" else result.get("stop_rank")
    if observed is not None:
        t_fault = observed["time_wall"] - per_rank[slow].get("detection_s", 0.0)
        out.append({"t": t_fault, "kind": "fault", "rank": "runner", "fault": fault_kind,
                    "target": target, "describe": f"{fault_kind} rank {target}"})
        out.append({"t": observed["time_wall"], "kind": "detected", "rank": slow,
                    "source": f"in-job:{observed.get('cause')}"})
        prev = observed["time_wall"]
        for kind, phase in _PHASE_EVENTS:
            if kind in tl:
                out.append({"t": tl[kind]["time_wall"], "kind": "recovery_phase", "rank": slow,
                            "phase": phase, "seconds": tl[kind]["time_wall"] - prev})
                prev = tl[kind]["time_wall"]
        if "first_collective" in tl:
            t_fc = tl["first_collective"]["time_wall"]
            out.append({"t": t_fc, "kind": "recovery_phase", "rank": slow,
                        "phase": "first_collective", "seconds": t_fc - prev})
            out.append({"t": t_fc, "kind": "recovery_end", "rank": slow, "path": "in-job",
                        "seconds": t_fc - t_fault, "world_size": len(result.get("survivors", [])),
                        "steps_lost": 0})
    if result.get("params_equal"):
        out.append({"t": t_end, "kind": "done", "rank": slow, "replicas_equal": True})
    return out


def run_ddp_recovery(plan: Plan, run_dir: str | Path | None = None) -> RunResult:
    """Runs the example under `plan`; the result's recovery_path is "in-job"."""
    import tempfile

    d = Path(run_dir or tempfile.mkdtemp(prefix=f"chaos-{plan.name}-"))
    res = RunResult(plan=plan, run_dir=str(d), recovery_path="in-job", attempts=1)
    why = available()
    if why:
        res.outcome, res.message = "skipped", why
        return res
    t0 = time.time()
    env = dict(os.environ, RESILIENT_LOG_LEVEL=os.environ.get("RESILIENT_LOG_LEVEL", "error"))
    try:
        p = subprocess.run(command(plan, d / "out"), capture_output=True, text=True, env=env,
                           timeout=plan.timeout + 30)
    except subprocess.TimeoutExpired:
        res.outcome, res.message = "timeout", "the in-job recovery example timed out"
        return res
    (d / "stdout.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    res.timeline = to_events(result, t0, time.time())
    res.final_world = len(result.get("survivors", []))
    if p.returncode == 0:
        res.outcome = "finished"
    elif p.returncode == 3:
        res.outcome = "unrecoverable"
        res.message = next((x for x in p.stderr.splitlines() if x.startswith("stopped")),
                           "stopped: fewer ranks than the minimum world size")
    else:
        res.outcome = "failed"
        res.message = f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"
    res.timeline.append({"t": time.time(), "kind": "run_end", "rank": "runner",
                         "outcome": res.outcome})
    return res
