"""``resilient run``: torchrun's command line on an agent that keeps survivors running.

    resilient run --standalone --nproc-per-node 4 train.py --epochs 3
    resilient run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host:29500 \\
        --rdzv-id job42 train.py
    python -m resilient.run ...   # the same

Every torchrun option is parsed by torch's own parser (``torch.distributed.run. get_args_parser``),
plus ``--[no-]in-process-recovery`` (default on), ``--replacements N`` and ``--spares N``. The agent
is resilient.recovery.agent.ResilientAgent (see there and docs/recovery.md, "Launching").
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

from resilient import settings


def build_parser(prog: str = "resilient run") -> argparse.ArgumentParser:
    """torchrun's parser with resilient's options added."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    parser.description = ("Launch a training script like torchrun, but when a worker dies the "
                          "others keep running and recover in process (resilient.recovery).")
    parser.add_argument(
        "--in-process-recovery", action=argparse.BooleanOptionalAction,
        default=bool(settings.get("RESILIENT_IN_PROCESS_RECOVERY")),
        help="keep the survivors when a worker dies (default: on; off: torchrun's behaviour, "
             "the whole group is stopped and restarted up to --max-restarts times)")
    parser.add_argument(
        "--replacements", type=int, default=0,
        help="start a new worker for a lost one, at most this many times per node; it joins "
             "the running job through Recovery's join path (default 0)")
    parser.add_argument(
        "--spares", type=int, default=0,
        help="start this many extra workers per node at launch that wait, initialized, until "
             "a worker is lost, then take its place (a hot spare: no process start, import or "
             "CUDA init after the failure). Spare i gets LOCAL_RANK nproc-per-node + i, so a "
             "GPU script that maps LOCAL_RANK to a device needs a GPU for it (default 0)")
    parser.add_argument(
        "--store", default=None, metavar="URL",
        help="etcd://h1:2379,h2:2379,h3:2379/prefix (etcds:// for TLS): the workers' default "
             "process group, and so the failure detector, recovery and checkpoint commits, use "
             "this etcd cluster as their store instead of one served by an agent (no single "
             "point of failure; an unmodified init_process_group() takes it once the script "
             "has imported resilient). Sets RESILIENT_STORE for the workers")
    parser.add_argument(
        "--store-ttl-s", type=float, default=60.0,
        help="with --store: the launch's keys in etcd are on a lease its agents keep alive, "
             "and expire this long after the last agent stopped (killed); a job that "
             "succeeded deletes them at once (default 60)")
    parser.add_argument(
        "--finish-grace-s", type=float, default=30.0,
        help="kill workers still running this long after another finished cleanly (ranks "
             "the survivors removed, e.g. frozen ones) without failing the job (default 30); "
             "a worker busy with the job's work (copying the newest checkpoint to its tiers in "
             "close()) gets it after that work, and killing one makes the launcher exit with "
             "4 (docs/operations.md)")
    return parser


def run(argv: list[str], prog: str = "resilient run") -> int:
    """Parses torchrun-style ``argv`` and runs the job; returns the launcher's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import config_from_args

    from resilient.recovery.agent import EXIT_WORKER_KILLED, WorkerKilledError, launch

    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.spares < 0 or args.replacements < 0:
        parser.error("--spares and --replacements take a count >= 0")
    if not args.store_ttl_s >= 1:
        parser.error("--store-ttl-s takes a number of seconds >= 1")
    if args.spares and not args.in_process_recovery:
        parser.error("--spares needs in-process recovery (a spare joins the running job)")
    if args.spares and args.store:
        parser.error("--spares does not work with --store yet (a spare finds the job through "
                     "the agent's TCPStore); use --replacements")
    if args.store:
        import os

        from resilient.recovery.environment import STORE_ENV

        if not args.store.startswith(("etcd://", "etcds://")):
            parser.error(f"--store takes an etcd:// or etcds:// URL, not {args.store!r}")
        try:
            from resilient.etcd import from_url

            from_url(args.store)  # checks the URL's form; connects to nothing
        except ValueError as e:
            parser.error(f"--store: {e}")
        os.environ[STORE_ENV] = args.store
    if args.standalone:  # as torch.distributed.run.run does
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    config, cmd, cmd_args = config_from_args(args)
    try:
        launch(config, cmd, cmd_args, in_process=args.in_process_recovery,
               replacements=args.replacements, spares=args.spares,
               finish_grace_s=args.finish_grace_s, store_ttl_s=args.store_ttl_s)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    except WorkerKilledError as e:
        print(f"resilient run: {e}", file=sys.stderr)
        return EXIT_WORKER_KILLED
    return 0


def add_parser(sub: Any) -> None:
    """Registers ``resilient run``; its arguments are parsed by :func:`build_parser` when it
    runs (so that ``resilient --help`` does not import torch)."""
    p = sub.add_parser("run", add_help=False, prefix_chars="\0",
                       help="launch a training script like torchrun, keeping survivors alive")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: run(a.argv))


def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv, prog="python -m resilient.run")


__all__ = ["add_parser", "build_parser", "main", "run"]
