"""Running a test's helper script in a process group of its own, bounded in time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Any, Callable

import pytest


def _communicate(args: list[str], timeout: float, what: str, stderr: int) -> tuple[int, str, str]:
    proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.PIPE, stderr=stderr,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} timed out:\n{(err or out)[-4000:]}")
    return proc.returncode, out, err or ""


def run_bounded(args: list[str], timeout: float, what: str) -> tuple[int, str]:
    """Runs `args` (stdout and stderr together); on timeout kills the whole process group and
    fails the test with the output's tail. Returns (exit code, output)."""
    rc, out, _ = _communicate(args, timeout, what, subprocess.STDOUT)
    return rc, out


def run_separate(args: list[str], timeout: float, what: str) -> tuple[int, str, str]:
    """run_bounded with stdout and stderr apart: (exit code, stdout, stderr)."""
    return _communicate(args, timeout, what, subprocess.PIPE)


def kill_mentioning(text: str) -> int:
    """SIGKILLs every process of this user whose command line contains `text` (a test's own
    temporary directory): workers a launcher started in sessions of their own outlive a
    SIGKILLed launcher. Returns how many."""
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            if text in cmdline:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> int | None:
    """Waits up to `timeout` s for `proc` (started with start_new_session=True); whatever
    happens, its whole session is SIGKILLed if it is still running. Returns its exit code."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode


def kill_at_marker(args: list[str], marker: str, timeout: float, what: str) -> None:
    """Starts `args` in a session of its own, waits (bounded) until it creates `marker` (a
    pause point it reached), then SIGKILLs its whole group; fails the test if it exits or times
    out first."""
    import time

    proc = subprocess.Popen(args, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(marker):
            assert proc.poll() is None, f"{what}: the child exited before the pause"
            assert time.monotonic() < deadline, f"{what}: the child never reached the pause"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def spawn_ranks(fn: Callable[[int, int, Any], None], nprocs: int = 2) -> dict:
    """Runs ``fn(rank, port, out)`` in `nprocs` spawned processes (a free port for their
    MASTER_PORT, `out` a shared dict) and returns what they put in `out`."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The manager's server process is spawned too: forked from this process, whose other
    # threads (the engine's, torch's) may hold the allocator's locks at the fork, its first
    # thread deadlocked once (CI, 2026-11-28: in Thread.__init__, for the test's full 600 s).
    with mp.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.start_processes(fn, args=(port, out), nprocs=nprocs, start_method="spawn",
                           join=True)
        return dict(out)
