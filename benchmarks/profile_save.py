"""Profiles the Python side of Checkpointer.save() for a model-shaped state (diagnosis only).

python benchmarks/profile_save.py --device cuda --model gpt-1b
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import torch

from resilient.checkpoint import Checkpointer
from resilient.cli.bench.shapes import make_state, model_shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="gpt-1b")
    ap.add_argument("--mode", default="overlap")
    args = ap.parse_args()
    state = make_state(model_shapes(args.model), torch.bfloat16, args.device)
    with tempfile.TemporaryDirectory(dir=".") as root, Checkpointer(root, keep=1) as ckpt:
        ckpt.save(0, state, mode=args.mode).wait()
        for i in range(3):
            t0 = time.perf_counter()
            h = ckpt.save(i + 1, state, mode=args.mode)
            ret = time.perf_counter() - t0
            h.wait()
            st = h.stats()
            print(f"return {ret * 1e3:.2f} ms, native issue {st['issue_s'] * 1e3:.2f} ms")
        prof = cProfile.Profile()
        prof.enable()
        h = ckpt.save(10, state, mode=args.mode)
        prof.disable()
        h.wait()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
