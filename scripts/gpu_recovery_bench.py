#!/usr/bin/env python3
"""In-process recovery vs the restart path on GPUs with NCCL (issue 6's GPU measurement).

    python scripts/gpu_recovery_bench.py --gpus 4 --out DIR [--repeat 3]

Runs examples/ddp_recovery.py with one rank per GPU (NCCL; the store hosted by this process):
``kill`` (a rank SIGKILLs itself mid-training; survivors shrink the NCCL group or re-create it,
keep their in-memory state and continue), ``stop`` (a rank SIGSTOPs itself: found by the
detector's suspicion timeout), and ``restart`` (torchrun's path: kill all workers, new processes
import torch, init NCCL, build the model, load the checkpoint, first all-reduce). Every time is
from the fault to the slowest survivor's first successful collective. Prints one JSON object and
writes it to DIR/recovery_bench.json. Each run is bounded by --timeout and every process started
is killed at the end of its run (and dies with its launcher).

Environment: TORCH_NCCL_ASYNC_ERROR_HANDLING=0 unless set (with the default, torch's watchdog may
tear a survivor down when it sees the dead peer's error before the shrink aborts the group);
--nccl-env KEY=VALUE adds or overrides variables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=4, help="ranks, one per GPU (2-8)")
    ap.add_argument("--out", default="build/gpu-recovery-bench")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scenarios", default="kill,stop,restart")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--nccl-env", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from recovery_bench import run_all

    if args.backend == "nccl" and torch.cuda.device_count() < args.gpus:
        print(json.dumps({"error": f"need {args.gpus} GPUs, found {torch.cuda.device_count()}"}))
        return 2
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")}
    for kv in args.nccl_env:
        key, _, value = kv.partition("=")
        env[key] = value
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "env": env}
    try:
        result.update(run_all(world=args.gpus, backend=args.backend, repeat=args.repeat,
                              out=out, scenarios=args.scenarios.split(","),
                              timeout_s=args.timeout, env=env))
    except Exception as e:  # noqa: BLE001 -- reported in the JSON, non-zero exit
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
    result["wall_s"] = time.monotonic() - t0
    text = json.dumps(result)
    (out / "recovery_bench.json").write_text(text)
    print(text)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
