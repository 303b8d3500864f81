"""`resilient bench straggler`: 4 CPU ranks (gloo), one slowed, the per-rank score timeline.

run_straggler_bench(argv) runs a clean phase and then slows one rank (examples/straggler_demo.py
calls it too), prints one line per window with every rank's worst-phase ratio (a '*' marks a slow
window, 'P' a persistent straggler), the detection summary, and with --plot writes a PNG of the
ratios over steps; with --json it prints one JSON object (the scenario, the detection summary and
the timeline) instead of the text.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

from resilient.straggler.sim import Scenario, ScenarioResult, run_world


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """4 CPU ranks (gloo), one slowed from a given step: the per-rank straggler score timeline
    and when the slow rank was named."""
    p = parser or argparse.ArgumentParser(prog="resilient bench straggler",
                                          description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="CPU processes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--slowdown", type=float, default=0.2, help="0.2 = 20%% more compute")
    p.add_argument("--slow-from", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=4.0, help="compute (sleep) per step")
    p.add_argument("--interval", type=int, default=10, help="steps per window")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    p.add_argument("--plot", metavar="PNG", nargs="?", const="straggler_timeline.png",
                   help="write the timeline plot (default name straggler_timeline.png)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (scenario, world, plot, result: the timeline and "
                        "when the slow rank was named) instead of text")
    return p


def format_timeline(res: ScenarioResult, world: int) -> list[str]:
    """One line per window: window, last step, then each rank's ratio and flags."""
    lines = ["window  step  " + "  ".join(f"rank{r:<5d}" for r in range(world))]
    by_window: dict[int, dict[int, dict]] = {}
    for p in res.timeline:
        by_window.setdefault(p["window"], {})[p["rank"]] = p
    for w in sorted(by_window):
        row = by_window[w]
        cells = []
        for r in range(world):
            p = row.get(r)
            if p is None or p["ratio"] is None or math.isnan(p["ratio"]):
                cells.append("   -     ")
                continue
            flag = "P" if p["persistent"] else ("*" if p["slow"] else " ")
            cells.append(f"{p['ratio']:5.2f}{flag}{p['phase'][:2]:<3s}")
        last = next(iter(row.values()))["last_step"]
        lines.append(f"{w:6d} {last:5d}  " + "  ".join(cells))
    return lines


def summary(res: ScenarioResult) -> list[str]:
    return [
        f"mean step: {res.mean_step_ms:.2f} ms",
        f"first named at step {res.first_named_step} (latency {res.detection_latency} steps), "
        f"phase {res.named_phase}, ratio {res.named_ratio:.2f}",
        f"persistent at step {res.first_persistent_step}, change point (since) step "
        f"{res.since_step}",
        f"false reports: {res.false_reports} (unexplained by the harness's timing: "
        f"{res.unexplained_reports})",
    ] + [f"report: {r}" for r in res.reports[:5]]


def plot(res: ScenarioResult, world: int, path: str, slow_from: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for r in range(world):
        pts = [p for p in res.timeline if p["rank"] == r and p["ratio"] is not None
               and not math.isnan(p["ratio"])]
        ax.plot([p["last_step"] for p in pts], [p["ratio"] for p in pts], label=f"rank {r}")
        slow = [p for p in pts if p["slow"]]
        ax.scatter([p["last_step"] for p in slow], [p["ratio"] for p in slow], marker="x",
                   color="black", zorder=3)
    ax.axvline(slow_from, color="grey", linestyle="--", label="slowdown starts")
    if res.first_named_step >= 0:
        ax.axvline(res.first_named_step, color="red", linestyle=":", label="named")
    ax.set_xlabel("step")
    ax.set_ylabel("worst phase / cross-rank median")
    ax.set_title("Straggler score timeline (x = slow window)")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_straggler_bench(argv: list[str] | None = None) -> int:
    """Entry point for `resilient bench straggler` and examples/straggler_demo.py."""
    args = build_parser().parse_args(argv)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    """Runs the benchmark from parsed arguments (for a CLI that built the parser itself)."""
    sc = Scenario("demo", args.steps, args.slow_rank, args.slowdown, args.slow_from,
                  base_s=args.step_ms / 1e3, interval=args.interval)
    res = run_world([sc], world=args.world, timeout_s=args.timeout)[0][0]
    if args.plot:
        plot(res, args.world, args.plot, args.slow_from)
    if getattr(args, "json", False):
        print(json.dumps(to_json(res, sc, args.world, args.plot), indent=1, allow_nan=False))
        return 0
    print("\n".join(format_timeline(res, args.world)))
    print("\n".join(summary(res)))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def to_json(res: ScenarioResult, sc: Scenario, world: int, plot_path: str | None) -> dict:
    """The run as one JSON-ready object (NaN ratios of empty windows become null)."""
    def clean(v: object) -> object:
        return None if isinstance(v, float) and math.isnan(v) else v

    out = asdict(res)
    out["timeline"] = [{k: clean(v) for k, v in p.items()} for p in res.timeline]
    out["detection_latency"] = res.detection_latency
    out["named_ratio"] = clean(res.named_ratio)
    return {"scenario": asdict(sc), "world": world, "plot": plot_path, "result": out}
