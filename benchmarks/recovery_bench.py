"""Recovery benchmark: in-process recovery against the restart path, measured the same way.

``python benchmarks/recovery_bench.py --world 4 --backend gloo --out DIR`` runs, with
``examples/ddp_recovery.py``:

* ``kill``: a rank SIGKILLs itself at a step; the survivors recover in process (from memory);
* ``stop``: a rank SIGSTOPs itself (frozen); found by the detector's suspicion timeout;
* ``restart``: the restart path as torchrun does it: the same job (with checkpoints every 2
  steps) loses a rank; the launcher notices the exit (polled every 0.1 s, torchrun's
  ``--monitor-interval`` default), SIGKILLs the other workers, starts ``world`` new processes
  that import torch, create a new group, build the model and optimizer, load the newest
  checkpoint and all-reduce once.

Every time is from the fault (the worker records ``time.monotonic()`` just before signalling
itself) to the slowest survivor's first successful collective. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from resilient.recovery.launch import LocalJob

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_recovery.py"
_KEYS = ("detection_s", "agreement_s", "rebuild_s", "restore_s", "first_collective_s",
         "total_s")


def run_inprocess(kind: str, *, world: int, backend: str, rank: int, step: int, steps: int,
                  out: Path, timeout_s: float, env: dict | None = None,
                  script: Path = EXAMPLE) -> dict[str, Any]:
    """One in-process recovery (``kind`` "kill" or "stop"); the slowest survivor's phases."""
    flag = "--kill" if kind == "kill" else "--stop"
    cmd = [sys.executable, str(script), "--world", str(world), "--backend", backend,
           "--steps", str(steps), f"{flag}-rank", str(rank), f"{flag}-step", str(step),
           "--out", str(out), "--timeout", str(timeout_s)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 30,
                       env=dict(os.environ, **(env or {})))
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} run failed ({p.returncode}):\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-2000:]}")
    res = json.loads(lines[-1])
    keep = {k: res[k] for k in _KEYS if k in res}
    keep.update(source=res.get("source"), method=res.get("method"),
                params_equal=res["params_equal"], steps=res["steps"])
    return keep


def run_restart(*, world: int, backend: str, rank: int, step: int, steps: int, out: Path,
                timeout_s: float, env: dict | None = None,
                script: Path = EXAMPLE) -> dict[str, Any]:
    """The restart path (see the module docstring); its phases, slowest process each."""
    ckpt = out / "ckpt"
    base = [sys.executable, str(script), "--worker", "--backend", backend,
            "--steps", str(steps)]
    train = base + ["--kill-rank", str(rank), "--kill-step", str(step), "--min-world",
                    str(world), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    deadline = time.monotonic() + timeout_s
    with LocalJob(train, world, out / "train", env=env) as job:
        job.spawn()
        t_detect = None
        while time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in job.procs.values()):
                t_detect = time.monotonic()
                break
            time.sleep(0.1)  # torchrun's default monitor interval
        if t_detect is None:
            raise TimeoutError("restart path: no worker failed")
        t_fault = job.fault_time()
        for r in range(world):  # torchrun stops every worker of the group
            job.signal(r, 9)
        job.wait(list(range(world)), 10)
        t_torn_down = time.monotonic()
        resume = LocalJob(base + ["--mode", "resume", "--checkpoint-dir", str(ckpt),
                                  "--restart-generation", "1"], world, out / "resume", env=env)
        resume.store = job.store  # the launcher's store survives the restart
        with resume:
            t_spawn = time.monotonic()
            resume.spawn()
            codes = resume.wait(list(range(world)), max(1.0, deadline - time.monotonic()))
            reps = [resume.report(r) for r in range(world)]
            if any(c != 0 for c in codes.values()) or any(r is None for r in reps):
                raise RuntimeError(f"restart path: resume failed {codes}: "
                                   f"{resume.log_tail(0)}")
    if t_fault is None:
        raise RuntimeError("restart path: the worker recorded no fault time")
    last = {k: max(r[k] for r in reps) for k in ("t_import", "t_init", "t_built", "t_loaded",
                                                  "t_first_collective")}
    return {
        "detection_s": t_detect - t_fault,
        "teardown_s": t_torn_down - t_detect,
        "spawn_import_s": last["t_import"] - t_spawn,
        "init_s": last["t_init"] - last["t_import"],
        "build_s": last["t_built"] - last["t_init"],
        "load_s": last["t_loaded"] - last["t_built"],
        "first_collective_s": last["t_first_collective"] - last["t_loaded"],
        "total_s": last["t_first_collective"] - t_fault,
        "loaded_step": reps[0]["step"],
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = {k for r in runs for k, v in r.items() if isinstance(v, float)}
    return {k: statistics.median(r[k] for r in runs if k in r) for k in sorted(keys)}


def run_all(*, world: int, backend: str, repeat: int, out: Path, scenarios: list[str],
            timeout_s: float, steps: int = 12, step: int = 5, env: dict | None = None
            ) -> dict[str, Any]:
    """Runs each scenario ``repeat`` times; returns every run and the medians."""
    result: dict[str, Any] = {"world": world, "backend": backend, "repeat": repeat}
    fault_rank = 1
    for name in scenarios:
        runs = []
        for i in range(repeat):
            d = out / f"{name}{i}"
            if name == "restart":
                runs.append(run_restart(world=world, backend=backend, rank=fault_rank,
                                        step=step, steps=steps, out=d, timeout_s=timeout_s,
                                        env=env))
            else:
                runs.append(run_inprocess(name, world=world, backend=backend, rank=fault_rank,
                                          step=step, steps=steps, out=d, timeout_s=timeout_s,
                                          env=env))
        result[name] = {"median": _median(runs), "runs": runs}
    if "kill" in result and "restart" in result:
        result["restart_over_kill"] = (result["restart"]["median"]["total_s"]
                                       / result["kill"]["median"]["total_s"])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--scenarios", default="kill,stop,restart")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--out", default="build/recovery-bench")
    args = ap.parse_args(argv)
    res = run_all(world=args.world, backend=args.backend, repeat=args.repeat,
                  out=Path(args.out), scenarios=args.scenarios.split(","),
                  timeout_s=args.timeout)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
