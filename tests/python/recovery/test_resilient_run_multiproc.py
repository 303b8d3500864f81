"""``resilient run``: torchrun's arguments, torch's elastic agent and rendezvous, survivors kept.

Pure: how the agent judges its workers' exits. End to end (4 gloo ranks of the ordinary DDP script
examples/ddp_resilient_run.py under ``python -m resilient.run --standalone``): a rank is killed
with SIGKILL from outside mid-run and the job still exits 0 with the failure-free parameters; with
``--replacements 1`` a new process joins the running job in the lost rank's place; a frozen
(SIGSTOP) rank is removed by the survivors and killed by the agent at the end; when recovery
is impossible (``min_world`` 4) the launcher fails the job. Each run is bounded and
killed with its whole session on the way out.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_resilient_run.py."""


from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


EXAMPLE = ROOT / "examples" / "ddp_resilient_run.py"


@pytest.mark.timeout(120)
def test_plain_torchrun_is_told_once_to_use_resilient_run(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLE), "--steps", "2", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
        text=True, timeout=100, start_new_session=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert out.count("this job runs under torchrun, whose agent SIGTERMs") == 1, out[-3000:]
    assert "Launch it with `resilient run`" in out
