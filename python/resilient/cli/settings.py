"""`resilient settings`: every RESILIENT_* setting, its type, default and meaning (markdown;
docs/SETTINGS.md is this output), or the values in effect in this environment."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from resilient import settings


def add_parser(sub: Any) -> None:
    p = sub.add_parser("settings", help="list every RESILIENT_* setting", description=__doc__)
    p.add_argument("--current", action="store_true",
                   help="print the settings set in this environment, parsed (errors included)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document: every setting (name, kind, default, meaning, "
                        "section, choices), or with --current {values, errors}")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not args.current:
        if args.json:
            print(json.dumps([{"name": s.name, "kind": s.kind, "default": s.default,
                               "shown": s.shown, "meaning": s.meaning, "section": s.section,
                               "choices": list(s.choices)}
                              for s in settings.SETTINGS.values()], indent=1))
        else:
            sys.stdout.write(settings.describe())
        return 0
    values, errors = {}, []
    for name in sorted(settings.SETTINGS):
        if not os.environ.get(name, "").strip():
            continue
        try:
            values[name] = settings.get(name)
        except ValueError as e:
            errors.append(str(e))
    if args.json:
        print(json.dumps({"values": values, "errors": errors}, indent=1, default=str))
    else:
        for name, value in values.items():
            print(f"{name}={value!r}")
        for e in errors:
            print(f"error: {e}")
    return 1 if errors else 0
