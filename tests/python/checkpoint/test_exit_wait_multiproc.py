"""Ctrl-C during a save: what exit waits for, for how long, and a second Ctrl-C (issue 44,
item 7). Exit waits for the save in flight at most RESILIENT_EXIT_TIMEOUT_S in all (close()'s
waits share one deadline), says so at once, and a second Ctrl-C abandons the save; the last
committed checkpoint stays loadable either way.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_exit_wait.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from test_exit_wait import _step1_loads

import machine

# Every write of step 2 sleeps 1 s (16 MiB in 1 MiB requests: 16 s or more in all).
SLOW = dict(RESILIENT_FAULT_OPS="write", RESILIENT_FAULT_ERRNO="0",
            RESILIENT_FAULT_DELAY_MS="1000", RESILIENT_FAULT_PATH="step-000000000002",
            RESILIENT_O_DIRECT="off", RESILIENT_IO_REQUEST_BYTES=str(1 << 20))


TRAINER = textwrap.dedent("""
    import signal, sys, time, torch, resilient
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive process
    ck = resilient.Checkpointer(sys.argv[1], create=True)
    ck.save(1, {"w": torch.ones(1 << 10)}).wait()
    ck.save(2, {"w": torch.ones(4 << 20)})
    print("training", flush=True)
    while True:          # the training loop, until Ctrl-C
        time.sleep(0.05)
""")


def _start(tmp_path, exit_timeout: str) -> subprocess.Popen:
    env = {**os.environ, **SLOW, "RESILIENT_EXIT_TIMEOUT_S": exit_timeout}
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path / "c")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "training"
    return proc


def _stderr_until(proc: subprocess.Popen, text: str, timeout: float = 60) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while text not in seen:
        assert time.monotonic() < deadline, seen
        line = proc.stderr.readline()
        assert line, f"stderr ended before {text!r}: {seen}"
        seen += line
    return seen


def test_exit_says_what_it_waits_for_and_keeps_its_bound(tmp_path):
    proc = _start(tmp_path, "6")
    try:
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        said = _stderr_until(proc, "press Ctrl-C again")
        assert "up to 6 s" in said and "step 2" in said, said
        proc.wait(90)
        exit_s = time.monotonic() - t0
    finally:
        proc.kill()
    # Three close() waits of 6 s each took up to 18 s before they shared one deadline; the
    # interpreter's exit after the wait gets what this machine's load stretches 4 s to, short
    # of those 18 s (the bug stays caught).
    limit = 6 + min(11.5, machine.deadline(4))
    assert exit_s < limit, f"exit took {exit_s:.1f} s with RESILIENT_EXIT_TIMEOUT_S=6"
    _step1_loads(tmp_path)


def test_a_second_ctrl_c_abandons_the_save(tmp_path):
    proc = _start(tmp_path, "120")
    try:
        proc.send_signal(signal.SIGINT)
        _stderr_until(proc, "press Ctrl-C again")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _stderr_until(proc, "abandoned")
        proc.wait(60)
        exit_s = time.monotonic() - t0
    finally:
        proc.kill()
    assert exit_s < 30, exit_s  # not the 120 s bound
    _step1_loads(tmp_path)
