"""`resilient settings`: every RESILIENT_* setting, its type, default and meaning (markdown;
docs/SETTINGS.md is this output), or the values in effect in this environment."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from resilient import settings


def add_parser(sub: Any) -> None:
    p = sub.add_parser("settings", help="list every RESILIENT_* setting", description=__doc__)
    p.add_argument("--current", action="store_true",
                   help="print the settings set in this environment, parsed (errors included)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not args.current:
        sys.stdout.write(settings.describe())
        return 0
    failed = 0
    for name in sorted(settings.SETTINGS):
        if not os.environ.get(name, "").strip():
            continue
        try:
            print(f"{name}={settings.get(name)!r}")
        except ValueError as e:
            print(f"error: {e}")
            failed += 1
    return 1 if failed else 0
