"""Flips every bit of a small checkpoint's manifest, one at a time, and loads the step after
each flip: counts flips caught (CorruptCheckpointError, IncompatibleCheckpointError, OSError),
flips that loaded the very state that was saved, and flips that loaded different state (must be
0). The bounded version runs in CI (tests/python/test_load_contract.py).

    python benchmarks/manifest_bitflip.py [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

import resilient
from resilient import CorruptCheckpointError, IncompatibleCheckpointError


def state_of(step: int) -> dict:
    return {"model": {"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.int64)},
            "optim": {"lr": 0.001, "betas": (0.9, 0.999)}, "step": step, "name": "run"}


def blank() -> dict:
    return {"model": {"w": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64)},
            "optim": {"lr": 0.0, "betas": (0.0, 0.0)}, "step": 0, "name": ""}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    logging.getLogger("resilient").setLevel(logging.ERROR)  # one "skipping step" line per flip
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d) / "c"
        with resilient.Checkpointer(root) as ck:
            ck.save(1, state_of(1)).wait()
        manifest = root / "step-000000000001" / "manifest.json"
        good = manifest.read_bytes()
        counts = {"bits": len(good) * 8, "caught": 0, "same_state": 0, "wrong_state": 0}
        wrong = []
        t0 = time.monotonic()
        for bit in range(len(good) * 8):
            bad = bytearray(good)
            bad[bit // 8] ^= 1 << (bit % 8)
            manifest.write_bytes(bytes(bad))
            target = blank()
            try:
                with resilient.Checkpointer(root) as ck:
                    ck.load(target, step=1)
            except (CorruptCheckpointError, IncompatibleCheckpointError, OSError):
                counts["caught"] += 1
                continue
            if same(target, state_of(1)):
                counts["same_state"] += 1
            else:
                counts["wrong_state"] += 1
                wrong.append(bit)
        counts["seconds"] = round(time.monotonic() - t0, 1)
        counts["manifest_bytes"] = len(good)
        counts["wrong_bits"] = wrong[:20]
    print(json.dumps(counts) if args.json else counts)


if __name__ == "__main__":
    main()
