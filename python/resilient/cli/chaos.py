"""Argument parsing and the top-level flow of `resilient chaos`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from resilient.chaos.plan import Plan, load_plans, parse_fault_flag, random_faults


def _plans(args: argparse.Namespace) -> list[Plan]:
    if args.plan:
        plans = load_plans(args.plan)
        if args.only:
            plans = [p for p in plans if p.name in args.only]
        return plans
    plan = Plan(name="cli", ranks=args.ranks, steps=args.steps, ckpt_every=args.ckpt_every,
                step_ms=args.step_ms, min_world_size=args.min_world_size, seed=args.seed,
                command=args.command or None, expect=args.expect, timeout=args.timeout)
    plan.faults = [parse_fault_flag(f) for f in args.fault]
    if args.random:
        plan.faults += random_faults(plan, args.random, args.seed)
    plan.validate()
    return [plan]


def run(args: argparse.Namespace) -> int:
    from resilient.chaos.report import aggregate, analyze, table
    from resilient.chaos.runner import reference_plan, run_plan

    plans = _plans(args)

    def run_dir(name: str) -> Path | None:
        # Each run's files (logs, events, checkpoints) are kept for inspection: under --dir,
        # else in a fresh temporary directory named in the report.
        if not args.dir:
            return None
        d = Path(args.dir) / name
        if d.exists() and any(d.iterdir()):
            # A previous run's checkpoints there would be resumed from and skew the result.
            raise SystemExit(f"resilient chaos: {d} is not empty; remove it or choose another "
                             "--dir")
        return d

    refs: dict[str, tuple[str | None, float | None]] = {}
    reports = []
    for plan in plans:
        ref_digest, ref_step = None, None
        if (plan.compare and not plan.command and not plan.adapter and plan.expect == "recovered"
                and not args.no_compare):
            ref = reference_plan(plan)
            key = json.dumps({k: v for k, v in asdict(ref).items() if k != "name"}, sort_keys=True)
            if key not in refs:
                rr = run_plan(ref, run_dir(ref.name), verbose=args.verbose)
                done = [e for e in rr.timeline if e["kind"] == "done"]
                refs[key] = (done[-1]["digest"] if done else None,
                             analyze(rr).step_s if done else None)
            ref_digest, ref_step = refs[key]
        res = run_plan(plan, run_dir(plan.name), verbose=args.verbose)
        reports.append((res, analyze(res, ref_digest, ref_step)))
        if not args.json:
            print(f"{plan.name}: {res.outcome}" + (f" ({res.message})" if res.message else ""),
                  file=sys.stderr)
    summary = aggregate([r for _, r in reports])
    if args.json:
        json.dump({"runs": [r.as_dict() for _, r in reports], "summary": summary}, sys.stdout,
                  indent=2, default=str)
        print()
    else:
        print(table([r for _, r in reports]))
        print("summary: " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
    if args.plot:
        from resilient.chaos.plot import plot_timelines

        plot_timelines([res for res, _ in reports], args.plot)
        print(f"timeline written to {args.plot}", file=sys.stderr)
    if args.check:
        return 1 if summary["violations"] else 0
    # without --check: non-zero when a run did not finish (unrecoverable, timeout)
    return 0 if all(r.outcome in ("finished", "skipped") for _, r in reports) else 2


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chaos", help="run a job under injected faults and report recovery",
        description="Runs a training job on N local ranks with a fault plan and reports "
        "detection, recovery by phase, steps lost, checkpoints, bit-exactness and ETTR.")
    p.add_argument("--plan", help="YAML/JSON plan file (one plan or defaults + scenarios)")
    p.add_argument("--only", nargs="+", help="run only these scenarios of the plan file")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--min-world-size", type=int, default=1)
    p.add_argument("--fault", action="append", default=[],
                   help="TYPE:key=value,... e.g. kill:rank=1,at_step=12 (repeatable)")
    p.add_argument("--random", type=int, default=0, help="add N random faults (see --seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expect", choices=["recovered", "unrecoverable"], default="recovered")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    p.add_argument("--no-compare", action="store_true", help="skip the fault-free reference run")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="write a timeline of every run")
    p.add_argument("--check", action="store_true",
                   help="exit non-zero if any run breaks an invariant or its expected outcome")
    p.add_argument("--dir", help="keep each run's files in DIR/<scenario> (default: a new "
                   "temporary directory per run, named in the report)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("command", nargs="*", help="job command (default: the built-in DDP job)")
    p.set_defaults(func=run)
