"""``resilient sim detector``: the real detector core of every rank on a simulated network. A
small run agrees on every failure with no false removal, and reports the store's load: the
operations, their rate, and the busiest 100 ms (every live rank reads each decided generation
once, so the load follows ranks x generations and arrives in a burst)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_small_simulation_agrees_and_reports_the_store_load() -> None:
    r = subprocess.run([sys.executable, "-m", "resilient", "sim", "detector", "--ranks", "256",
                        "--duration", "8", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["agreed"] and row["undetected"] == 0 and row["false_positives"] == 0, row
    gens, ranks = row["generations"], row["ranks"]
    assert gens >= 1
    # each survivor reads each generation once; proposals add a few
    assert (ranks - row["failures"]) * gens <= row["store_ops"] <= 2 * ranks * gens, row
    assert row["store_ops_per_s"] == row["store_ops"] / row["sim_seconds"]
    assert row["store_ops_per_s"] <= row["store_peak_ops_per_s"] <= 10 * row["store_ops"], row
