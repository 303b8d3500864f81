"""resilient: keep PyTorch training jobs running through failures (checkpoints, detection,
recovery).

The console script. Each subcommand lives in its own module of this package (bench, sim,
chaos, settings, ckpt) and exposes `add_parser(subparsers)`, which registers the subcommand
and sets `func(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that implements it
_SUBCOMMANDS = {
    "bench": "resilient.cli.bench",
    "sim": "resilient.cli.sim",
    "chaos": "resilient.cli.chaos",
    "settings": "resilient.cli.settings",
    "ckpt": "resilient.cli.ckpt",
    "run": "resilient.cli.run",
}

DESCRIPTION = ("Keep PyTorch training jobs running through failures: checkpoints, failure "
               "detection, recovery.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resilient", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for _name, module_name in _SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not module_name.startswith(e.name):
                raise
            continue  # this subcommand's module is not part of this checkout
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
