"""DCP's storage alone: dcp.save/dcp.load of one process's model-shaped state through torch's
FileSystemWriter/Reader and through resilient.dcp, in one run (the FSDP2 comparison, where DCP's
own planning and get/set_state_dict weigh in, is `resilient bench --fsdp --methods
dcp,dcp_resilient,...`).

python benchmarks/dcp_backend.py --model gpt-125m --dtype float32 --repeat 3

No process group: DCP runs its single-process path. The page cache is dropped before every load
(when allowed), every load is checked bit for bit, and medians are printed with the ratios
(resilient.dcp / FileSystemWriter; < 1: ahead).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from resilient.cli.bench.methods import drop_cache
from resilient.cli.bench.shapes import make_state, model_shapes, state_bytes
from resilient.dcp import ResilientStorageReader, ResilientStorageWriter


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # random bytes hold NaNs: compare bits, not values


def run(state: dict[str, torch.Tensor], base: Path, backend: str, repeat: int) -> dict:
    saves, loads, cache = [], [], ""
    root = base / backend
    # One writer for the run, as a training loop keeps one (its engine and pool are reused).
    writer = ResilientStorageWriter(root, keep=1) if backend == "resilient" else None
    for step in range(repeat + 1):  # the first is a warm-up
        path = str(root / f"step-{step}")
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path, storage_writer=writer)
        save_s = time.perf_counter() - t0
        target = {k: torch.empty_like(v) for k, v in state.items()}
        cache = drop_cache(base)
        t0 = time.perf_counter()
        reader = None if backend == "filesystem" else ResilientStorageReader(root)
        dcp.load(target, checkpoint_id=path, storage_reader=reader)
        load_s = time.perf_counter() - t0
        if not all(torch.equal(_bytes(target[k]), _bytes(state[k])) for k in state):
            raise SystemExit(f"{backend}: step {step} did not load bit for bit")
        if step:
            saves.append(save_s)
            loads.append(load_s)
        if backend == "filesystem" and step:
            shutil.rmtree(root / f"step-{step - 1}", ignore_errors=True)
    if writer is not None:
        writer.close()
    return {"backend": backend, "save_s": statistics.median(saves),
            "load_s": statistics.median(loads), "saves": saves, "loads": loads, "cache": cache}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = make_state(model_shapes(args.model), getattr(torch, args.dtype), "cpu")
    nbytes = state_bytes(state)
    base = Path(tempfile.mkdtemp(prefix="dcp-backend-", dir=args.dir))
    try:
        rows = [run(state, base, b, args.repeat) for b in ("filesystem", "resilient")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fs, res = rows
    result = {"model": args.model, "dtype": args.dtype, "bytes": nbytes, "tensors": len(state),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "rows": rows, "save_ratio": res["save_s"] / fs["save_s"],
              "load_ratio": res["load_s"] / fs["load_s"]}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.model} ({args.dtype}): {nbytes / 2**30:.2f} GiB in {len(state)} tensors, "
          f"one process, medians of {args.repeat} (cache: {fs['cache']})")
    for r in rows:
        print(f"  {r['backend']:>10}: save {r['save_s']:.3f} s ({nbytes / r['save_s'] / 1e9:.2f} "
              f"GB/s), load {r['load_s']:.3f} s ({nbytes / r['load_s'] / 1e9:.2f} GB/s)")
    print(f"  resilient.dcp / FileSystemWriter: save {result['save_ratio']:.2f}x, "
          f"load {result['load_ratio']:.2f}x")


if __name__ == "__main__":
    main()
