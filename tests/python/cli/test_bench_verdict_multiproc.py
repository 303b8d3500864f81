"""`resilient bench` ends with a verdict a first-time user can read: a legend of the columns,
each goal with its value, and for a goal missed whether the library or the machine missed it; a
method known to fail on this torch is skipped with the reason, not a FAILED row.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_bench_verdict.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilient.cli.bench import verdict


def test_the_first_run_prints_a_legend_goals_and_a_verdict(tmp_path: Path) -> None:
    """The default command's output, at a small size: no FAILED row, no torch warning, every
    column explained, every goal with a number, a verdict last."""
    pytest.importorskip("torch")
    cli = "import sys; from resilient.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", cli, "bench", "--size", "8MiB", "--tensors", "8",
                        "--repeat", "1", "--dir", str(tmp_path / "scratch")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "FAILED" not in out and "Warning" not in p.stderr
    assert "dcp_async skipped" in out or "dcp_async " in out
    for name, _ in verdict.LEGEND:
        assert f"  {name} " in out
    goal_lines = [ln for ln in out.splitlines() if "target" in ln]
    assert goal_lines and all(" - " not in ln.split("target")[0] for ln in goal_lines)
    assert out.strip().splitlines()[-1].startswith("verdict: ")
