"""`resilient sim <model>`: simulations that drive resilient's real decision logic at scale.

Each model is a sub-subcommand registered in _MODELS (``detector`` here; others, such as
``ettr``, add themselves the same way: a function ``add_<model>_parser(subparsers)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable


def _detector(args: argparse.Namespace) -> int:
    from resilient._C import detect as native

    rows = []
    for n in args.ranks:
        o = native.SimOptions()
        o.ranks = n
        o.duration_s = args.duration if args.duration else (10.0 if n > 20000 else 20.0)
        o.warmup_s = min(3.0, o.duration_s / 4)
        o.latency_ms = args.latency_ms
        o.jitter_ms = args.jitter_ms
        o.loss = args.loss
        o.crashes = args.crashes
        o.silent_failures = args.silent
        o.pauses = args.pauses
        o.pause_ms = args.pause_ms
        o.tick_ms = args.tick_ms
        o.seed = args.seed
        rows.append(native.run_simulation(o).as_dict())
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    cols = [("ranks", "ranks", "{:d}"), ("sim s", "sim_seconds", "{:.0f}"),
            ("fail", "failures", "{:d}"), ("miss", "undetected", "{:d}"),
            ("all p50 ms", "detect_all_p50_ms", "{:.0f}"),
            ("all p99 ms", "detect_all_p99_ms", "{:.0f}"),
            ("crash p50", "crash_p50_ms", "{:.0f}"), ("silent p50", "silent_p50_ms", "{:.0f}"),
            ("rank p50", "per_rank_p50_ms", "{:.0f}"), ("rank p99", "per_rank_p99_ms", "{:.0f}"),
            ("FP", "false_positives", "{:d}"), ("false susp", "false_suspicions", "{:d}"),
            ("msg/s/rank", "messages_per_rank_per_s", "{:.1f}"),
            ("store ops", "store_ops", "{:d}"), ("store/s", "store_ops_per_s", "{:.0f}"),
            ("store peak/s", "store_peak_ops_per_s", "{:.0f}"), ("agreed", "agreed", "{}"),
            ("wall s", "wall_seconds", "{:.1f}")]
    print(" | ".join(h for h, _, _ in cols))
    for r in rows:
        print(" | ".join(f.format(r[k]).rjust(len(h)) for h, k, f in cols))
    return 0 if all(r["agreed"] and r["undetected"] == 0 for r in rows) else 1


def add_detector_parser(sub: Any) -> None:
    p = sub.add_parser("detector", help="failure-detector discrete-event simulation",
                       description="Drives the real C++ detector state machine of every rank "
                       "over a simulated network with jitter, loss, pauses and crashes.")
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384, 100000])
    p.add_argument("--duration", type=float, default=0.0,
                   help="simulated seconds (default 20, 10 above 20k ranks)")
    p.add_argument("--latency-ms", type=float, default=0.3)
    p.add_argument("--jitter-ms", type=float, default=0.5, help="mean exponential extra delay")
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--crashes", type=int, default=3, help="killed processes (port refuses)")
    p.add_argument("--silent", type=int, default=2, help="frozen hosts (no refusal)")
    p.add_argument("--pauses", type=int, default=5, help="ranks paused, then resumed")
    p.add_argument("--pause-ms", type=float, default=600)
    p.add_argument("--tick-ms", type=float, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_detector)


# model name -> function registering its parser; other components append theirs here.
_MODELS: dict[str, Callable[[Any], None]] = {"detector": add_detector_parser}


def _add_ettr_parser(sub: Any) -> None:
    from resilient.chaos.ettr import add_ettr_parser

    add_ettr_parser(sub)


_MODELS["ettr"] = _add_ettr_parser


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("sim", help="simulations at scale")
    models = p.add_subparsers(dest="model", required=True)
    for register in _MODELS.values():
        register(models)


__all__ = ["add_detector_parser", "add_parser"]
