"""Expected effective training time ratio (ETTR) under failures, and the best checkpoint
interval: `resilient sim ettr`.

Model (Daly 2006, "A higher order estimate of the optimum checkpoint interval"; exponential
failures). Training needs T_s seconds of work; every tau seconds of work the job stalls delta
seconds to checkpoint; failures arrive with mean time between failures M (for the whole job);
each failure costs R seconds (detection + recovery) plus the work since the last checkpoint.
The expected wall-clock time is

    T_w = M * exp(R / M) * (exp((tau + delta) / M) - 1) * T_s / tau

so ETTR = T_s / T_w does not depend on T_s. The best tau maximises it (found numerically;
Young's first-order sqrt(2 * delta * M) is printed beside it). The two recovery paths differ in
R: the resilient path pays detector latency + in-job recovery (agree, rebuild, restore from host
memory or peers); restart-from-storage pays a timeout-based detection + tearing the job down,
rescheduling, process start and a load from storage, and it can only roll back to the last
*durable* checkpoint, which lags the snapshot by the persist time P (added to its R). Under this
model the best tau depends only on delta and M: recovery costs lower ETTR at every interval
but do not move the optimum; the paths' intervals differ when their stalls differ (e.g. a
blocking save to storage on the restart path). The job MTBF scales as M = MTTF_ref *
gpus_ref / gpus (independent failures).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class PathCosts:
    """Costs of one recovery path, in seconds."""

    name: str
    detect_s: float
    recover_s: float
    stall_s: float  # training stall per checkpoint
    persist_s: float = 0.0  # lag from snapshot to durable, when recovery needs durable state


def ettr(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Expected ETTR for work interval tau, checkpoint stall delta, per-failure cost restart
    and job MTBF mtbf (all seconds). 0 when the job cannot make progress."""
    if tau <= 0 or mtbf <= 0:
        return 0.0
    x = restart / mtbf + math.log(math.expm1((tau + delta) / mtbf)) + math.log(mtbf / tau)
    return math.exp(-x) if x < 700 else 0.0


def best_interval(delta: float, restart: float, mtbf: float) -> tuple[float, float]:
    """(tau, ETTR) maximising ettr(); ETTR is unimodal in tau, so a log-scale scan followed by
    golden-section refinement finds it."""
    lo, hi = math.log(1e-3), math.log(max(10.0 * mtbf, 1.0))
    grid = [lo + (hi - lo) * i / 400 for i in range(401)]
    k = max(range(len(grid)), key=lambda i: ettr(math.exp(grid[i]), delta, restart, mtbf))
    a, b = grid[max(0, k - 1)], grid[min(len(grid) - 1, k + 1)]
    g = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c, d = b - g * (b - a), a + g * (b - a)
        if ettr(math.exp(c), delta, restart, mtbf) >= ettr(math.exp(d), delta, restart, mtbf):
            b = d
        else:
            a = c
    tau = math.exp((a + b) / 2)
    return tau, ettr(tau, delta, restart, mtbf)


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum sqrt(2 * delta * M)."""
    return math.sqrt(2 * delta * mtbf)


def job_mtbf_s(mttf_hours: float, at_gpus: int, gpus: int) -> float:
    """Job MTBF in seconds for `gpus`, from an MTTF measured at `at_gpus` (linear scaling)."""
    return mttf_hours * 3600.0 * at_gpus / gpus


def evaluate(paths: list[PathCosts], mtbf: float, interval_s: float | None = None
             ) -> list[dict[str, Any]]:
    """One row per path: the best interval and its ETTR, Young's interval, and the ETTR at
    `interval_s` when given."""
    rows = []
    for p in paths:
        r = p.detect_s + p.recover_s + p.persist_s
        tau, best = best_interval(p.stall_s, r, mtbf)
        row = {**asdict(p), "mtbf_s": mtbf, "failure_cost_s": r, "best_interval_s": tau,
               "best_ettr": best, "young_interval_s": young_interval(p.stall_s, mtbf)}
        if interval_s:
            row["interval_s"] = interval_s
            row["ettr_at_interval"] = ettr(interval_s, p.stall_s, r, mtbf)
        rows.append(row)
    return rows


def measured_restart_costs(chaos_json: str) -> tuple[float, float]:
    """(mean detection s, mean recovery s) of the rank faults in a `resilient chaos --json`
    output (the restart path measured on this machine)."""
    with open(chaos_json) as f:
        doc = json.load(f)
    det, rec = [], []
    for run in doc["runs"]:
        if run.get("recovery_path", "restart") != "restart":
            continue
        for inc in run["incidents"]:
            if inc["fault"] in ("kill", "stop", "partition", "kill_during_save"):
                if inc["detected_s"] is not None:
                    det.append(inc["detected_s"])
                if inc["recovered_s"] is not None:
                    rec.append(inc["recovered_s"] - (inc["detected_s"] or 0.0))
    if not rec:
        raise ValueError(f"{chaos_json}: no recovered rank fault to measure")
    return (sum(det) / len(det) if det else 0.0), sum(rec) / len(rec)


def _run(args: argparse.Namespace) -> int:
    mtbf = (args.mtbf_hours * 3600.0 if args.mtbf_hours
            else job_mtbf_s(args.mttf_hours, args.at_gpus, args.gpus))
    restart_detect, restart_recover = args.restart_detect_s, args.restart_recover_s
    if args.chaos_json:
        restart_detect, restart_recover = measured_restart_costs(args.chaos_json)
    paths = [PathCosts("resilient", args.detect_s, args.recover_s, args.stall_s),
             PathCosts("restart", restart_detect, restart_recover,
                       args.restart_stall_s if args.restart_stall_s is not None else args.stall_s,
                       args.persist_s)]
    rows = evaluate(paths, mtbf, args.interval_s)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(f"job MTBF {mtbf / 3600:.3f} h ({args.gpus} GPUs; MTTF {args.mttf_hours} h at "
          f"{args.at_gpus})" if not args.mtbf_hours else f"job MTBF {args.mtbf_hours} h")
    head = ["path", "detect s", "recover s", "persist s", "stall s", "best interval", "best ETTR",
            "Young interval"] + (["ETTR at interval"] if args.interval_s else [])
    print(" | ".join(head))
    for r in rows:
        vals = [r["name"], f"{r['detect_s']:.2f}", f"{r['recover_s']:.1f}", f"{r['persist_s']:.1f}",
                f"{r['stall_s']:.2f}", f"{r['best_interval_s']:.0f} s",
                f"{r['best_ettr']:.4f}", f"{r['young_interval_s']:.0f} s"]
        if args.interval_s:
            vals.append(f"{r['ettr_at_interval']:.4f}")
        print(" | ".join(v.rjust(len(h)) for v, h in zip(vals, head)))
    print("(Daly model: the best interval depends on the stall and the MTBF only; recovery "
          "cost lowers ETTR at every interval. docs/operations.md)")
    return 0


def add_ettr_parser(sub: Any) -> None:
    """Registers `resilient sim ettr`."""
    p = sub.add_parser("ettr", help="expected ETTR and best checkpoint interval under failures",
                       description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--gpus", type=int, default=16384)
    p.add_argument("--mttf-hours", type=float, default=1.8,
                   help="job MTTF measured at --at-gpus GPUs")
    p.add_argument("--at-gpus", type=int, default=16384)
    p.add_argument("--mtbf-hours", type=float, default=0.0, help="the job MTBF directly")
    p.add_argument("--stall-s", type=float, default=0.5, help="training stall per checkpoint")
    p.add_argument("--restart-stall-s", type=float, default=None,
                   help="stall per checkpoint on the restart path (default: --stall-s)")
    p.add_argument("--detect-s", type=float, default=2.0, help="resilient: detection")
    p.add_argument("--recover-s", type=float, default=30.0,
                   help="resilient: agree + rebuild + restore + first collective")
    p.add_argument("--restart-detect-s", type=float, default=120.0,
                   help="restart path: detection (collective timeout)")
    p.add_argument("--restart-recover-s", type=float, default=600.0,
                   help="restart path: teardown, reschedule, start, load from storage")
    p.add_argument("--persist-s", type=float, default=20.0,
                   help="restart path: snapshot -> durable on storage (lost on a failure)")
    p.add_argument("--chaos-json", help="take the restart path's costs from `resilient chaos "
                   "--json` output")
    p.add_argument("--interval-s", type=float, default=None, help="also evaluate this interval")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)
