"""Summarizes the logs of `scripts/gpu_run.sh ab-fsdp-save` (benchmarks/profile_fsdp_save.py
runs named ...-<variant>.log): per run and per variant, the overlapped save's return (median and
quartiles over every timed step of every rank), the return over the d2h floor, and where the
call went (SaveHandle.stats(): prepare_s, collective_s, submit_s, issue_s).

python benchmarks/summarize_fsdp_saves.py benchmarks/results/h200x2-fsdp-return-ab3/*.log
"""

from __future__ import annotations

import ast
import re
import statistics
import sys

_STEP = re.compile(r"rank (\d+) step (\d+) (\w+): return ([\d.]+) s stall ([\d.]+) s (\{.*\})")
_D2H = re.compile(r"rank (\d+) d2h reference: ([\d.]+) s")
_PHASES = ("prepare_s", "collective_s", "submit_s", "issue_s")


def read(path: str) -> tuple[float, list[tuple[float, dict]]]:
    """(the d2h floor: the fastest rank's reference copy; [(return s, stats)] of overlap steps)."""
    d2h, steps = float("inf"), []
    with open(path) as f:
        for line in f:
            if m := _D2H.match(line):
                d2h = min(d2h, float(m[2]))
            elif (m := _STEP.match(line)) and m[3] == "overlap":
                steps.append((float(m[4]), ast.literal_eval(m[6])))
    return d2h, steps


def row(label: str, d2h: float, steps: list[tuple[float, dict]]) -> str:
    returns = sorted(r for r, _ in steps)
    q1, med, q3 = statistics.quantiles(returns, n=4) if len(returns) > 1 else returns * 3
    phases = " ".join(
        f"{k[:-2]} {statistics.median(s[k] for _, s in steps) * 1e3:4.1f}"
        if all(k in s for _, s in steps) else f"{k[:-2]}   - "
        for k in _PHASES)
    return (f"{label:44s} n={len(returns):3d} return ms: median {med * 1e3:5.1f} "
            f"(q1 {q1 * 1e3:5.1f}, q3 {q3 * 1e3:5.1f}) / d2h {d2h * 1e3:5.1f} = "
            f"{med / d2h:.3f} | medians ms: {phases}")


def main(paths: list[str]) -> None:
    by_variant: dict[str, list] = {}
    floors = []
    for path in paths:
        variant = re.search(r"-(\w+)\.log$", path)[1]
        d2h, steps = read(path)
        if not steps:
            continue
        floors.append(d2h)
        by_variant.setdefault(variant, []).extend(steps)
        print(row(path.rsplit("/", 2)[-1], d2h, steps))
    floor = statistics.median(floors)
    for variant, steps in by_variant.items():
        print(row(f"all {variant} (d2h: median of the runs' floors)", floor, steps))


if __name__ == "__main__":
    main(sys.argv[1:])
