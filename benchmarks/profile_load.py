"""Diagnoses load() and overlapped-save timings for a model-shaped state (diagnosis only).

python benchmarks/profile_load.py --device cuda --model gpt-1b

Prints, per retention setting, load times right after a save (retention's purge may still run)
and after a pause, one cProfile of load(), and the stats of overlapped saves. Works with an
earlier package too (PYTHONPATH=.baseline), to compare the two on one machine.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch

from resilient.checkpoint import Checkpointer
from resilient.cli.bench.methods import drop_cache
from resilient.cli.bench.shapes import make_state, model_shapes, state_bytes


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_load(ck, state, step, device) -> float:
    drop_cache(Path(ck.root))
    sync(device)
    t0 = time.perf_counter()
    ck.load(state, step=step)
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="gpt-1b")
    ap.add_argument("--pause", type=float, default=3.0)
    args = ap.parse_args()
    state = make_state(model_shapes(args.model), torch.bfloat16, args.device)
    gb = state_bytes(state) / 1e9
    print(f"state {gb:.2f} GB, {len(state)} tensors")
    for keep in (1, 0):
        with tempfile.TemporaryDirectory(dir=".") as root, Checkpointer(root, keep=keep) as ck:
            for step in range(3):
                ck.save(step, state).wait()
            at_once = timed_load(ck, state, 2, args.device)
            time.sleep(args.pause)
            paused = timed_load(ck, state, 2, args.device)
            print(f"keep={keep}: load right after the save {gb / at_once:.2f} GB/s "
                  f"({at_once:.3f} s),"
                  f" after {args.pause} s {gb / paused:.2f} GB/s ({paused:.3f} s)")
            if keep == 1:
                drop_cache(Path(root))
                prof = cProfile.Profile()
                prof.enable()
                ck.load(state, step=2)
                sync(args.device)
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
            for step in range(3, 6):
                t0 = time.perf_counter()
                h = ck.save(step, state, mode="overlap")
                ret = time.perf_counter() - t0
                h.wait_snapshot()
                h.wait()
                st = {k: round(v, 4) for k, v in h.stats().items() if isinstance(v, float)}
                print(f"keep={keep} overlap save: return {ret:.4f} s, stats {st}")
                time.sleep(args.pause)


if __name__ == "__main__":
    main()
