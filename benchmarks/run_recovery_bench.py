"""Recovery under ``resilient run``: time from a rank's SIGKILL to training again, in process
(survivors only, a hot spare, a replacement) and on torchrun's restart path, in one run.

    python benchmarks/run_recovery_bench.py --nproc 2 --device cuda --out DIR [--repeat 2]

Each scenario launches ``examples/ddp_resilient_run.py --user-loop`` (the user's own loop, the
DDP model adopted by Recovery) with ``python -m resilient.run --standalone``; rank
``--kill-rank`` SIGKILLs itself at the start of step ``--kill-step`` after writing the time
(CLOCK_MONOTONIC, shared by the processes of one host):

* ``survivors``: the others recover in process; until the first completed collective of the
  slowest survivor (its ``first_collective`` timeline event);
* ``spare``: ``--spares 1``: a spare started at launch, initialized and waiting, is admitted at
  the first step boundary after the survivors' recovery; until its first completed collective
  (the group is whole again). With ``--device cuda`` the spare maps LOCAL_RANK ``nproc`` to GPU
  ``nproc % count``, so the killed rank must be the one on that GPU (rank 0 on 2 GPUs);
* ``replacement``: ``--replacements 1``: a process started after the loss (import, CUDA and
  NCCL init) joins; until its first completed collective (the members pause at the step after
  the kill until it has asked to join, so that it joins before the run ends);
* ``device``: the rank's device fails instead (a real device-side assert on CUDA, which poisons
  its context): it exits with 75 and the launcher restarts it alone (``--max-restarts 1``); the
  survivors recover meanwhile; measured as ``replacement``;
* ``restart``: ``--no-in-process-recovery --max-restarts 1``: torchrun's path, every worker
  stopped and started again; until the new group's first collective (DDP's initial parameter
  broadcast, the timeline's ``started``). Nothing is loaded from storage, so this is a lower
  bound of the restart-from-storage path.

``--fsdp``: the example's model is sharded with FSDP2; the survivors and the spare restore the
shards from peers' host memory (docs/recovery.md). ``--hsdp``: the same as HSDP over 2 replica
groups (a world of 3 after the loss shards over all 3; a spare makes it HSDP again).

Every run is bounded by ``--timeout``; a run that fails is reported with its output's tail.
Prints one JSON object and writes it to DIR/run_recovery_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ddp_resilient_run.py"
SCENARIOS = {
    "survivors": [],
    "spare": ["--spares", "1"],
    "replacement": ["--replacements", "1"],
    "restart": ["--no-in-process-recovery", "--max-restarts", "1"],
    "device": ["--max-restarts", "1"],
}


WARMUP_PHASES = ("allocated", "voted", "issued", "completed")


def first_event(events: list[dict], kind: str, after: float) -> float | None:
    times = [e["time_mono"] for e in events if e["kind"] == kind and e["time_mono"] >= after]
    return min(times) if times else None


def phases(events: list[dict], after: float) -> dict[str, float]:
    """The first event of each kind at or after ``after``, in seconds after it."""
    out: dict[str, float] = {}
    for e in sorted(events, key=lambda e: e["time_mono"]):
        if e["time_mono"] >= after and e["kind"] not in out:
            out[e["kind"]] = round(e["time_mono"] - after, 4)
    return out


def measure(scenario: str, out: Path, kill_rank: int) -> dict[str, Any]:
    """Seconds from the kill to training again, from the ranks' reports in ``out``."""
    t_kill = float((out / f"rank{kill_rank}.killed").read_text())
    reports = {p.name: json.loads(p.read_text()) for p in out.glob("rank*.json")}
    joiners = [r for r in reports.values() if r.get("joined")]
    res: dict[str, Any] = {"final_world": max((r["world_size"] for r in reports.values()),
                                              default=0),
                           "steps": sorted({r["step"] for r in reports.values()})}
    if scenario == "restart":
        ends = [first_event(r["timeline"], "started", t_kill) for r in reports.values()]
    elif scenario == "survivors":
        ends = [first_event(r["timeline"], "first_collective", t_kill)
                for r in reports.values() if not r.get("joined")]
    else:
        if not joiners:
            raise RuntimeError(f"{scenario}: no rank joined ({sorted(reports)})")
        ends = [first_event(r["timeline"], "first_collective", t_kill) for r in joiners]
        members = [r for r in reports.values() if not r.get("joined")]
        shrunk = [first_event(r["timeline"], "first_collective", t_kill) for r in members]
        if all(t is not None for t in shrunk) and shrunk:
            res["survivors_s"] = round(max(shrunk) - t_kill, 4)
        admitted = [first_event(r["timeline"], "join_admitted", t_kill) for r in members]
        if all(t is not None for t in admitted) and admitted:
            res["admitted_s"] = round(max(admitted) - t_kill, 4)
    # where the time went: each rank's events after the kill (first of each kind), in seconds
    res["phases"] = {name.removesuffix(".json"): phases(r["timeline"], t_kill)
                     for name, r in sorted(reports.items())}
    # the NCCL warm-up's own phases (seconds from its start), where one ran
    warm = {name.removesuffix(".json"): {k: v for k, v in e.items() if k in WARMUP_PHASES}
            for name, r in sorted(reports.items()) for e in r["timeline"]
            if e["kind"] == "nccl_warmed" and e["time_mono"] >= t_kill}
    if warm:
        res["warmup"] = warm
    if not ends or any(t is None for t in ends):
        raise RuntimeError(f"{scenario}: a rank has no collective after the kill")
    res["seconds"] = round(max(ends) - t_kill, 4)  # type: ignore[type-var]
    return res


def run_one(scenario: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node",
           str(a.nproc), "--finish-grace-s", "10", *SCENARIOS[scenario], str(EXAMPLE),
           "--device", a.device, "--user-loop", "--steps", str(a.steps), "--kill-rank",
           str(a.kill_rank), "--kill-step", str(a.kill_step), "--out", str(out),
           "--step-sleep", str(a.step_sleep)] + (["--fsdp"] if a.fsdp or a.hsdp else []) + (
               ["--hsdp"] if a.hsdp else [])
    if scenario in ("replacement", "device"):  # the members wait for its ticket, so it joins
        cmd += ["--wait-for-joiner", str(a.kill_step + 1)]  # before the end
    if scenario == "device":
        cmd += ["--fault", "device"]
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'python'}:{os.environ.get('PYTHONPATH', '')}")
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env,
                       start_new_session=True)
    if p.returncode != 0:
        raise RuntimeError(f"{scenario}: exit {p.returncode}\n{p.stderr[-3000:]}")
    res = measure(scenario, out, a.kill_rank)
    res["wall_s"] = round(time.monotonic() - t0, 2)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--scenarios", default="survivors,spare,replacement,restart")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--kill-step", type=int, default=20,
                    help="late enough that a spare started with the job is waiting (it "
                         "warms its compute first)")
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    ap.add_argument("--fsdp", action="store_true",
                    help="the example's FSDP2 model (shards restored from peers' memory)")
    ap.add_argument("--hsdp", action="store_true",
                    help="--fsdp as HSDP over 2 replica groups (--nproc 4 or more, even)")
    ap.add_argument("--out", default="build/run-recovery-bench")
    a = ap.parse_args(argv)
    out = Path(a.out)
    result: dict[str, Any] = {"nproc": a.nproc, "device": a.device, "fsdp": a.fsdp or a.hsdp,
                              "hsdp": a.hsdp, "kill_rank": a.kill_rank,
                              "kill_step": a.kill_step, "runs": {}, "summary": {}}
    if a.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
    for scenario in a.scenarios.split(","):
        runs = []
        for i in range(a.repeat):
            try:
                runs.append(run_one(scenario, a, out / f"{scenario}{i}"))
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as e:
                runs.append({"error": str(e)[-3000:]})
            print(scenario, i, json.dumps(runs[-1])[:300], file=sys.stderr, flush=True)
        result["runs"][scenario] = runs
        ok = [r["seconds"] for r in runs if "seconds" in r]
        if ok:
            result["summary"][scenario] = {"median_s": round(statistics.median(ok), 4),
                                           "min_s": min(ok), "max_s": max(ok), "n": len(ok)}
    summ = result["summary"]
    if "restart" in summ:
        for name in ("survivors", "spare", "replacement"):
            if name in summ:
                summ[name]["restart_over_this"] = round(
                    summ["restart"]["median_s"] / summ[name]["median_s"], 2)
    text = json.dumps(result, indent=1)
    (out / "run_recovery_bench.json").write_text(text)
    print(text)
    return 0 if all(s in summ for s in a.scenarios.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
