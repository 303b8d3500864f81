"""Checkpointer: round trips of every kind of state, and every bad-input path.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_checkpoint.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import torch

import resilient

WRITER = textwrap.dedent("""
    import sys, torch, resilient
    ckpt = resilient.Checkpointer(sys.argv[1], keep=3)
    step = 0
    while True:
        step += 1
        ckpt.save(step, {"w": torch.full((1 << 20,), float(step)), "step": step}).wait()
        print(step, flush=True)
""")


def test_kill_9_during_saves_never_leaves_a_corrupt_latest(tmp_path):
    """A process saving in a loop is killed at random moments; what is committed always loads."""
    rng = np.random.default_rng(0)
    for _trial in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        try:
            first = proc.stdout.readline()  # at least one committed step
            assert first.strip(), "writer produced no checkpoint"
            time.sleep(float(rng.uniform(0.0, 0.5)))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        with resilient.Checkpointer(tmp_path, keep=3) as ckpt:
            state = {"w": torch.zeros(1 << 20), "step": 0}
            step = ckpt.load(state)
            assert step is not None and ckpt.last_load.skipped == []
            assert state["step"] == step and torch.equal(
                state["w"], torch.full((1 << 20,), float(step))
            )
