"""LocalJob.close(): a hung rank's log shows where it hung, and the rank dies with everything it
started; a stopped rank is killed too; ranks that already exited cost no wait."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from resilient.recovery.launch import LocalJob

HUNG = r"""
import os, subprocess, sys, time
import resilient  # RESILIENT_CRASH_HANDLER=1 (set by LocalJob): SIGUSR1 dumps the stacks
out = sys.argv[sys.argv.index("--out") + 1]
rank = sys.argv[sys.argv.index("--rank") + 1]
child = subprocess.Popen(["sleep", "600"])
open(os.path.join(out, f"child{rank}"), "w").write(str(child.pid))
def waiting_for_a_dead_peer():
    time.sleep(600)
waiting_for_a_dead_peer()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


@pytest.mark.timeout(120)
def test_close_dumps_hung_ranks_and_kills_their_groups(tmp_path: Path) -> None:
    job = LocalJob([sys.executable, "-c", HUNG], world=2, out_dir=tmp_path)
    try:
        job.spawn()
        children = [int(_wait_for(tmp_path / f"child{r}")) for r in range(2)]
        job.signal(1, signal.SIGSTOP)  # a frozen rank: cannot dump, must still die
        time.sleep(0.2)
    finally:
        job.close()
    hung = (tmp_path / "rank0.log").read_text()
    assert "waiting_for_a_dead_peer" in hung, hung[-2000:]
    assert all(p.poll() is not None for p in job.procs.values())
    for pid in children:
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"rank's child {pid} survived close()"


@pytest.mark.timeout(60)
def test_close_after_clean_exits_is_immediate(tmp_path: Path) -> None:
    job = LocalJob([sys.executable, "-c", "pass"], world=2, out_dir=tmp_path)
    job.spawn()
    assert job.wait([0, 1], 30) == {0: 0, 1: 0}
    t0 = time.monotonic()
    job.close()
    assert time.monotonic() - t0 < 0.4
