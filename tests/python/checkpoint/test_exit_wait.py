"""Ctrl-C during a save: what exit waits for, for how long, and a second Ctrl-C (issue 44,
item 7). Exit waits for the save in flight at most RESILIENT_EXIT_TIMEOUT_S in all (close()'s
waits share one deadline), says so at once, and a second Ctrl-C abandons the save; the last
committed checkpoint stays loadable either way."""


from __future__ import annotations

import time

import pytest
import torch

import resilient
from resilient import _C


def _step1_loads(tmp_path) -> None:
    with resilient.Checkpointer(tmp_path / "c") as ck:
        state = {"w": torch.zeros(1 << 10)}
        assert ck.load(state) == 1 and torch.equal(state["w"], torch.ones(1 << 10))


def test_close_takes_at_most_its_timeout_in_all(tmp_path):
    ck = resilient.Checkpointer(tmp_path / "c", create=True, o_direct="off",
                                request_bytes=1 << 20)
    ck.save(1, {"w": torch.ones(1 << 10)}).wait()
    _C.install_fault_hook(["write"], 0, path_contains="step-000000000002", delay_ms=1000)
    try:
        ck.save(2, {"w": torch.ones(4 << 20)})
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            ck.close(3)
        took = time.monotonic() - t0
    finally:
        _C.clear_fault_hook()
    assert took < 7, f"close(3) took {took:.1f} s"
    _step1_loads(tmp_path)
