"""Runs `resilient bench` from another copy of the Python package (an earlier commit's
`python/resilient`, with this build's `_C.so` copied into it) or from this tree, so that an
ABAB comparison shares the machine, the disk and the native core.

    python benchmarks/ab_package.py /tmp/basepkg -- --size 512MiB --tensors 64 --json
    python benchmarks/ab_package.py this -- --size 512MiB --tensors 64 --json
"""

from __future__ import annotations

import sys


def main() -> int:
    where, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    if where != "this":  # the editable install's finder would win over sys.path: drop it
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()
                            and "editable" not in type(f).__module__.lower()]
        sys.path.insert(0, where)
    import resilient
    from resilient.cli import main as cli

    print(f"resilient from {resilient.__file__}", file=sys.stderr)
    return int(cli(["bench", *rest]) or 0)


if __name__ == "__main__":
    sys.exit(main())
