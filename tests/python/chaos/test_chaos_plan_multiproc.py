"""Chaos plans, the events helper, the report's arithmetic and invariants (synthetic
timelines), and the fault mechanics that need no job: file faults, corruption, duty cycle.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_chaos_plan.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from resilient.chaos import faults as fx


def test_fault_env_reaches_a_fresh_process(tmp_path):
    pytest.importorskip("torch")
    root = str(tmp_path / "ck")
    code = ("import torch\n"
            "from resilient.checkpoint import Checkpointer\n"
            f"ck = Checkpointer({root!r})\n"
            "try:\n    ck.save(1, {'w': torch.ones(10)}).wait(30)\nexcept OSError as e:\n"
            "    print('errno', e.errno)\n")
    env = dict(os.environ, RESILIENT_FAULT_OPS="write", RESILIENT_FAULT_ERRNO="ENOSPC",
               RESILIENT_LOG_LEVEL="error")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "errno 28" in out.stdout, out.stderr


def test_duty_cycle_slows_and_always_resumes_the_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         start_new_session=True)
    try:
        dc = fx.DutyCycle(p.pid, stop_ms=30, run_ms=30, duration=5)
        time.sleep(0.2)
        dc.stop()
        with open(f"/proc/{p.pid}/stat") as f:
            assert f.read().split()[2] != "T"  # not left stopped
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
