"""Running a test's helper script in a process group of its own, bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run_bounded(args: list[str], timeout: float, what: str) -> tuple[int, str]:
    """Runs `args` (stdout and stderr together); on timeout kills the whole process group and
    fails the test with the output's tail. Returns (exit code, output)."""
    proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} timed out:\n{output[-4000:]}")
    return proc.returncode, output
