"""Numbers from a chaos run's timeline: detection time, recovery time by phase, steps lost,
checkpoints written / verified / skipped, bit-exactness against a fault-free run, ETTR, and the
invariants the CI matrix asserts. Definitions are in docs/operations.md."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from resilient.chaos.plan import RANK_FAULTS, RunResult


@dataclass
class Incident:
    """One injected fault and what followed it."""

    fault: str
    target: Any
    t_fault: float
    detected_s: float | None = None  # fault -> first signal (job's detector, runner, save error)
    detected_by: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # teardown, restart, load, replay
    recovered_s: float | None = None  # fault -> training back at the step it had reached
    steps_lost: int = 0
    loaded_step: int | None = None
    expected_step: int | None = None


@dataclass
class RunReport:
    name: str
    expected: str
    outcome: str
    message: str
    recovery_path: str
    wall_s: float
    steps: int
    incidents: list[Incident]
    written: int
    failed_saves: int
    verified: int
    skipped: int
    loaded_corrupt: bool
    lost_committed: bool
    bit_exact: bool | None
    ettr: float | None
    step_s: float
    violations: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first(tl: list[dict], t0: float, pred) -> dict | None:
    return next((e for e in tl if e.get("t", 0) >= t0 and pred(e)), None)


def analyze(res: RunResult, reference_digest: str | None = None,
            reference_step_s: float | None = None) -> RunReport:
    tl = res.timeline
    plan = res.plan
    launches = [e for e in tl if e["kind"] == "launch"]
    t_start = launches[0]["t"] if launches else (tl[0]["t"] if tl else 0.0)
    t_end = next((e["t"] for e in reversed(tl) if e["kind"] in ("done", "run_end")), t_start)
    steps = [e for e in tl if e["kind"] == "step"]
    # steady step time: median interval between consecutive steps of one rank in one process
    gaps: list[float] = []
    last: dict[Any, dict] = {}
    for e in steps:
        prev = last.get(e.get("pid"))
        if prev is not None and e["step"] == prev["step"] + 1:
            gaps.append(e["t"] - prev["t"])
        last[e.get("pid")] = e
    step_s = statistics.median(gaps) if gaps else 0.0
    base_step_s = reference_step_s or step_s
    saves_ok = [e for e in tl if e["kind"] == "save_end" and e.get("ok")]
    saves_bad = [e for e in tl if e["kind"] == "save_end" and not e.get("ok")]
    loads = [e for e in tl if e["kind"] == "load"]
    skipped = {s for e in loads for s, _ in (e.get("skipped") or [])}
    violations: list[str] = []
    loaded_corrupt = any(e.get("step") in res.corrupted for e in loads)
    if loaded_corrupt:
        violations.append("a corrupted checkpoint was loaded")

    incidents = []
    faults = [e for e in tl if e["kind"] == "fault"]
    for f in faults:
        inc = Incident(fault=f["fault"], target=f.get("target"), t_fault=f["t"] - t_start)
        t_f = f["t"]
        in_job = _first(tl, t_f, lambda e: e["kind"] == "recovery_end")
        relaunch_after = _first(tl, t_f, lambda e: e["kind"] == "launch")
        if f["fault"] in RANK_FAULTS and in_job and (
                relaunch_after is None or in_job["t"] < relaunch_after["t"]):
            # recovered in place by the job's recovery loop
            sig = _first(tl, t_f, lambda e: e["kind"] == "detected")
            if sig:
                inc.detected_s, inc.detected_by = sig["t"] - t_f, sig.get("source", "detected")
            for e in tl:
                if e["kind"] == "recovery_phase" and t_f <= e["t"] <= in_job["t"]:
                    inc.phases[e["phase"]] = inc.phases.get(e["phase"], 0.0) + e["seconds"]
            inc.recovered_s = in_job["t"] - t_f
            inc.steps_lost = int(in_job.get("steps_lost") or 0)
            inc.loaded_step = in_job.get("step")
        elif f["fault"] in RANK_FAULTS:
            sig = _first(tl, t_f, lambda e: e["kind"] in ("detected", "runner_detected"))
            if sig:
                inc.detected_s = sig["t"] - t_f
                inc.detected_by = sig.get("source", sig["kind"])
            td = _first(tl, t_f, lambda e: e["kind"] == "teardown_done")
            relaunch = _first(tl, t_f, lambda e: e["kind"] == "launch")
            ready = relaunch and _first(tl, relaunch["t"], lambda e: e["kind"] == "init_done")
            load = relaunch and _first(tl, relaunch["t"], lambda e: e["kind"] == "load")
            reached = f.get("step") or 0
            if f["fault"] == "kill_during_save":
                reached = max(reached, int(f.get("saving_step") or 0))
            if sig and td:
                inc.phases["teardown"] = td["t"] - sig["t"]
            if relaunch and ready:
                inc.phases["restart"] = ready["t"] - relaunch["t"]
            if load and ready:
                inc.phases["load"] = max(0.0, load["t"] - ready["t"])
            if load:
                inc.loaded_step = load.get("step")
                inc.steps_lost = max(0, reached - int(load.get("step") or 0))
                back = _first(tl, load["t"], lambda e, r=reached: e["kind"] == "step"
                              and e["step"] >= r)
                if back:
                    inc.phases["replay"] = back["t"] - load["t"]
                    inc.recovered_s = back["t"] - t_f
                elif any(e["kind"] == "done" for e in tl if e["t"] >= load["t"]):
                    inc.recovered_s = t_end - t_f
        elif f["fault"] in ("eio", "enospc"):
            bad = _first(tl, t_f, lambda e: e["kind"] == "save_end" and not e.get("ok"))
            if bad:
                inc.detected_s, inc.detected_by = bad["t"] - t_f, "save error"
                inc.recovered_s = 0.0  # training never stopped
        elif f["fault"] == "corrupt" and f.get("corrupted_step") is not None:
            skip = _first(tl, t_f, lambda e, s=f["corrupted_step"]: e["kind"] == "load"
                          and s in [x for x, _ in (e.get("skipped") or [])])
            if skip is None:  # no older step verified either: the job stopped on it
                skip = _first(tl, t_f, lambda e: e["kind"] == "fatal"
                              and "checksum" in str(e.get("message", "")))
            if skip:
                inc.detected_s, inc.detected_by = skip["t"] - t_f, "checksum on load"
        incidents.append(inc)

    # a committed checkpoint is never lost: each restart loads the newest committed step that
    # was not deliberately corrupted, and the newest committed step survives to the end
    restarts = [e for e in tl if e["kind"] == "launch"][1:]
    for rl in restarts:
        before = sorted({e["step"] for e in saves_ok if e["t"] < rl["t"]} - set(res.corrupted))
        load = _first(tl, rl["t"], lambda e: e["kind"] == "load")
        if load is None:
            continue
        got = load.get("step")
        if before and (got is None or got < before[-1]):
            violations.append(f"restart loaded step {got}, but step {before[-1]} was committed")
    lost_committed = any("was committed" in v for v in violations)
    newest_ok = max((e["step"] for e in saves_ok), default=None)
    if (newest_ok is not None and newest_ok not in res.corrupted
            and res.outcome == "finished" and newest_ok not in res.committed_at_end):
        violations.append(f"committed step {newest_ok} is missing at the end")
        lost_committed = True

    done = [e for e in tl if e["kind"] == "done"]
    bit_exact = None
    if reference_digest is not None and done:
        bit_exact = done[-1].get("digest") == reference_digest
        if not bit_exact:
            violations.append("final model differs from the fault-free run")
    for e in tl:
        if e["kind"] == "fault_missed":
            violations.append(f"{e['describe']} was not injected: {e['why']}")
    if res.outcome == "skipped":
        violations = []  # not run (e.g. no root for a partition): reported, not a failure
    elif plan.expect == "recovered" and res.outcome != "finished":
        violations.append(f"expected recovery, got {res.outcome}: {res.message}")
    if plan.expect == "unrecoverable" and res.outcome not in ("unrecoverable", "skipped"):
        violations.append(f"expected an unrecoverable failure, got {res.outcome}")
    for inc in incidents:
        if (plan.expect == "recovered" and inc.fault in RANK_FAULTS
                and inc.recovered_s is None and res.outcome == "finished"):
            violations.append(f"{inc.fault} on rank {inc.target}: no recovery measured")
    wall = max(1e-9, t_end - t_start)
    ettr: float | None = 0.0
    if res.outcome == "finished":
        # no step events (an adapter's job): not measured
        ettr = min(1.0, plan.steps * base_step_s / wall) if base_step_s > 0 else None
    return RunReport(
        name=plan.name, expected=plan.expect, outcome=res.outcome, message=res.message,
        recovery_path=res.recovery_path, wall_s=wall, steps=plan.steps, incidents=incidents,
        written=len(saves_ok), failed_saves=len(saves_bad), verified=len(res.verified),
        skipped=len(skipped), loaded_corrupt=loaded_corrupt, lost_committed=lost_committed,
        bit_exact=bit_exact, ettr=ettr, step_s=step_s, violations=violations)


def aggregate(reports: list[RunReport]) -> dict[str, Any]:
    """MTBF, MTTR, availability, detection coverage and automatic-recovery rate over runs."""
    run = [r for r in reports if r.outcome != "skipped"]
    wall = sum(r.wall_s for r in run)
    rank_inc = [i for r in run for i in r.incidents if i.fault in RANK_FAULTS]
    # automatic recovery is asked of the faults a plan declares recoverable
    recoverable = [i for r in run if r.expected == "recovered" for i in r.incidents
                   if i.fault in RANK_FAULTS]
    det_inc = [i for r in run for i in r.incidents if i.fault != "slow"]
    recovered = [i for i in recoverable if i.recovered_s is not None]
    mttr = statistics.mean(i.recovered_s for i in recovered) if recovered else 0.0
    mtbf = wall / len(rank_inc) if rank_inc else float("inf")
    return {
        "runs": len(run),
        "skipped": [r.name for r in reports if r.outcome == "skipped"],
        "failures": len(rank_inc),
        "mtbf_s": mtbf,
        "mttr_s": mttr,
        "availability": mtbf / (mtbf + mttr) if rank_inc else 1.0,
        "detection_coverage": (sum(i.detected_s is not None for i in det_inc) / len(det_inc)
                               if det_inc else 1.0),
        "auto_recovery_rate": len(recovered) / len(recoverable) if recoverable else 1.0,
        "unrecoverable_runs": sum(r.outcome == "unrecoverable" for r in run),
        "violations": sum(len(r.violations) for r in reports),
    }


def table(reports: list[RunReport]) -> str:
    """The per-run table printed by `resilient chaos`."""
    cols = ["run", "outcome", "path", "faults", "detect s", "recover s", "phases (s)", "lost",
            "ckpt w/v/s", "exact", "ETTR", "ok"]
    rows = []
    for r in reports:
        inc = r.incidents
        det = [i.detected_s for i in inc if i.detected_s is not None]
        rec = [i.recovered_s for i in inc if i.recovered_s is not None and i.fault in RANK_FAULTS]
        phases: dict[str, float] = {}
        for i in inc:
            for k, v in i.phases.items():
                phases[k] = phases.get(k, 0.0) + v
        rows.append([
            r.name, r.outcome, r.recovery_path, ",".join(i.fault for i in inc) or "-",
            "/".join(f"{d:.2f}" for d in det) or "-", "/".join(f"{x:.2f}" for x in rec) or "-",
            " ".join(f"{k[:4]}={v:.2f}" for k, v in phases.items()) or "-",
            str(sum(i.steps_lost for i in inc)), f"{r.written}/{r.verified}/{r.skipped}",
            {None: "-", True: "yes", False: "NO"}[r.bit_exact],
            "-" if r.ettr is None else f"{r.ettr:.2f}",
            "yes" if not r.violations else "NO"])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    for r in reports:
        for v in r.violations:
            lines.append(f"  ! {r.name}: {v}")
        if r.outcome in ("unrecoverable", "skipped") and r.message:
            lines.append(f"  {r.name}: {r.outcome}: {r.message}")
    return "\n".join(lines)
