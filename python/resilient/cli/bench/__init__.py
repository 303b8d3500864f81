"""`resilient bench`: the checkpoint/restore benchmark (`--world-size N`: N DDP-style processes;
`--fsdp`: FSDP2-sharded state with AdamW, saved, restored and resharded; and `resilient bench
straggler`)."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from resilient import _C
from resilient.cli.bench import verdict

# gpt-1b in float32 with AdamW is 15.7 GB, and dcp.async_save's stager copies it once more:
# more than a 24 GiB host holds. gpt-350m (4.3 GB) fits with every method's copies.
FSDP_CPU_MODEL = "gpt-350m"

ALL_METHODS = [
    "raw",
    "resilient",
    "resilient_overlap",
    "torch.save",
    "dcp",
    "dcp_async",
    "dcp_async_fresh",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="checkpoint/restore benchmark (and `bench straggler`)", description=__doc__
    )
    p.add_argument(
        "--size", default="256MiB", help="synthetic state size, e.g. 4GiB (default 256MiB)"
    )
    p.add_argument("--tensors", type=int, default=64, help="number of synthetic tensors")
    p.add_argument(
        "--model",
        default=None,
        help="use a named model's parameter shapes (gpt-125m, gpt-1b...; --fsdp default: "
        f"{FSDP_CPU_MODEL} on cpu, gpt-1b on cuda)",
    )
    p.add_argument(
        "--dtype", default=None, help="bfloat16 (default), --fsdp: float32 (FSDP2's sharded "
        "parameters and AdamW state)"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of " + ",".join(ALL_METHODS) + " (--fsdp: of "
        "resilient,resilient_overlap,dcp,dcp_async, and on request the resilient.dcp rows "
        "dcp_resilient,dcp_resilient_async,dcp_resilient_async_own; --world-size N: of "
        "sharded,sharded_redist,sharded_shm,every_rank,dcp)",
    )
    p.add_argument(
        "--dir",
        default="./resilient-bench",
        help="scratch directory on the storage to test (removed after)",
    )
    p.add_argument("--request-bytes", default="16MiB")
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--zstd-level", type=int, default=0)
    p.add_argument(
        "--train",
        action="store_true",
        help="also time a small transformer training loop with and without overlapped saves (CUDA)",
    )
    p.add_argument(
        "--train-batch",
        type=int,
        default=64,
        help="sequences of 512 tokens per training step (default 64: bound by the GPU, not the "
        "host's kernel launches)",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="measured repetitions per method (median reported)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="N > 1: N processes (one per GPU with --device cuda, NCCL); sharded save vs every "
        "rank writing everything vs DCP (default 1; --fsdp: ranks of the FSDP2 mesh, default 4 "
        "on cpu; with --device cuda one per GPU, default every GPU)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="with --world-size N: emulate this many hosts on this machine (consecutive ranks "
        "share one; RESILIENT_HOST_ID per rank), so the shared restore exchanges between them",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2-sharded model + AdamW state over --world-size ranks: resilient blocking and "
        "overlap vs dcp.save and dcp.async_save; stall, durable, write, restore, and restore "
        "onto half the ranks (every restore verified)",
    )
    p.set_defaults(func=run)
    kinds = p.add_subparsers(dest="kind")
    from resilient.cli.bench.straggler import build_parser

    s = kinds.add_parser(
        "straggler",
        help="straggler detection timeline (see docs/straggler.md)",
        description=build_parser.__doc__,
    )
    build_parser(s)
    s.set_defaults(func=run_straggler)


def run_straggler(args: argparse.Namespace) -> int:
    from resilient.cli.bench.straggler import run_from_args

    return int(run_from_args(args) or 0)


def progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.fsdp:
        from resilient.cli.bench.fsdp import FSDP_METHODS, run_fsdp_bench

        args.dtype = args.dtype or "float32"
        args.model = args.model or (FSDP_CPU_MODEL if args.device == "cpu" else "gpt-1b")
        args.methods = args.methods or ",".join(FSDP_METHODS)
        return run_fsdp_bench(args)
    args.world_size = args.world_size or 1
    args.dtype = args.dtype or "bfloat16"
    if args.world_size > 1:
        from resilient.cli.bench.world import WORLD_METHODS, run_world_bench

        args.world_methods = args.methods or ",".join(WORLD_METHODS)
        unknown = {m.strip() for m in args.world_methods.split(",") if m.strip()} - set(
            WORLD_METHODS)
        if unknown:
            print(f"error: unknown methods {sorted(unknown)} with --world-size (choose from "
                  f"{', '.join(WORLD_METHODS)})", file=sys.stderr)
            return 2
        return run_world_bench(args)
    args.methods_given = args.methods is not None
    args.methods = args.methods or ",".join(ALL_METHODS)
    import torch

    from resilient.cli.bench import methods as m
    from resilient.cli.bench.shapes import make_state, model_shapes, state_bytes, synthetic_shapes

    dtype = getattr(torch, args.dtype)
    if args.train_batch < 1:
        print(f"error: --train-batch must be at least 1, got {args.train_batch}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    wanted = [x.strip() for x in args.methods.split(",") if x.strip()]
    unknown = set(wanted) - set(ALL_METHODS)
    if unknown:
        print(f"error: unknown methods {sorted(unknown)}", file=sys.stderr)
        return 2
    shapes = (
        model_shapes(args.model)
        if args.model
        else synthetic_shapes(_C.parse_bytes(args.size), args.tensors, dtype)
    )
    state = make_state(shapes, dtype, args.device)
    nbytes = state_bytes(state)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    quiet = args.json
    progress(
        f"{nbytes / 2**30:.2f} GiB in {len(state)} tensors on {args.device}, scratch {root}", quiet
    )
    request_bytes = _C.parse_bytes(args.request_bytes)
    rows = []
    started = time.time()
    watch = verdict.MachineWatch().start()
    try:
        progress("reference copy", quiet)
        ref = m.d2h_row if args.device == "cuda" else m.memcpy_row
        rows.append(ref(state, nbytes, args.repeat))
        for name in wanted:
            why = None if args.methods_given else m.known_failure(name, torch.__version__)
            if why:
                progress(f"{name}: skipped ({why})", quiet)
                rows.append(m.Row(name, ok=False, skipped=why))
                continue
            progress(name, quiet)
            d = root / name.replace(".", "_")
            d.mkdir(parents=True, exist_ok=True)
            if name == "raw":
                fn = lambda d=d: m.raw_row(nbytes, d, request_bytes, args.queue_depth, args.repeat)  # noqa: E731
            elif name.startswith("resilient"):
                opts = {
                    "request_bytes": request_bytes,
                    "queue_depth": args.queue_depth,
                    "zstd_level": args.zstd_level,
                }
                mode = "overlap" if name == "resilient_overlap" else "blocking"

                def fn(d=d, mo=mode, opts=opts):
                    def paired() -> tuple[float, float]:
                        return m.raw_pair(nbytes, d, request_bytes, args.queue_depth)

                    return m.resilient_row(state, nbytes, d, args.device, opts, args.repeat, mo,
                                           paired if "raw" in wanted else None)
            elif name == "torch.save":
                fn = lambda d=d: m.torch_save_row(state, nbytes, d, args.device, args.repeat)  # noqa: E731
            elif name == "dcp":
                fn = lambda d=d: m.dcp_row(state, nbytes, d, args.device, args.repeat)  # noqa: E731
            else:
                reuse = name == "dcp_async"

                def fn(d=d, r=reuse):
                    return m.dcp_async_row(state, nbytes, d, args.device, args.repeat, r)  # noqa: E731

            rows.append(m.run_guarded(name, fn))
            shutil.rmtree(d, ignore_errors=True)
        if args.train:
            from resilient.cli.bench.training import train_row

            progress("training loop with and without overlapped saves", quiet)
            d = root / "train"
            d.mkdir(parents=True, exist_ok=True)
            rows.append(
                m.run_guarded(
                    "train_overlap",
                    lambda: train_row(
                        d,
                        args.device,
                        progress_fn=lambda s: progress(s, quiet),
                        batch=args.train_batch,
                    ),
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine = watch.stop()
    result = {
        "bytes": nbytes,
        "tensors": len(state),
        "dtype": args.dtype,
        "device": args.device,
        "model": args.model,
        "host": platform.node(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.time() - started, 1),
        "machine": machine,
        "rows": [r.to_dict() for r in rows],
    }
    result["goals"] = verdict.goals(result["rows"], args.device)
    judged = verdict.Machine.judge(machine, result["rows"])
    result["machine"]["reasons"] = judged.reasons
    result["verdict"] = verdict.verdict(result["goals"], judged)[1]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result, judged)
    return 0


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def print_table(result: dict, machine: verdict.Machine) -> None:
    """The rows, a legend of the columns, each goal with its value and the verdict."""
    m = result["machine"]
    print(
        f"resilient bench: {result['bytes'] / 2**30:.2f} GiB in {result['tensors']} tensors "
        f"({result['dtype']}, {result['device']}), torch {result['torch']}, {result['date']}, "
        f"{m['cpus']} CPUs, load average {m['loadavg_start']} -> {m['loadavg_end']}"
    )
    cols = ["method", "return_s", "stall_s", "durable_s", "write_gbps", "restore_gbps",
            "warm_gbps"]
    print(" ".join(f"{c:>13}" for c in cols))
    for r in result["rows"]:
        if r.get("skipped"):
            print(f"{r['method']:>13} skipped: {r['skipped']}")
        elif not r["ok"]:
            print(f"{r['method']:>13} FAILED: {r['error']}")
        else:
            print(" ".join(f"{_fmt(r[c]):>13}" for c in cols))
    print("columns (medians of the repeats; --json has every one):")
    for name, text in verdict.LEGEND:
        print(f"  {name:<13} {text}")
    print("goals (ratios within this run):")
    lines, end = verdict.verdict(result["goals"], machine)
    for line in lines:
        print(line)
    print(end)
