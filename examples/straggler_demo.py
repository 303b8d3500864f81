"""Straggler detection demo: 4 CPU ranks (gloo, torch.multiprocessing), rank 2 slowed by 20%
from step 100. Prints the per-rank score timeline; --plot writes a PNG.

    python examples/straggler_demo.py --plot straggler.png [--slowdown 0.5 --slow-rank 1]

Same as `resilient bench straggler`; all options: --help.
"""

from __future__ import annotations

import sys

from resilient.cli.bench.straggler import run_straggler_bench

if __name__ == "__main__":
    sys.exit(run_straggler_bench(sys.argv[1:]))
