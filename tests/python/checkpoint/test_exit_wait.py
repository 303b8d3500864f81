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


def test_a_close_that_times_out_keeps_the_root_until_the_save_ends(tmp_path):
    """close(timeout) that runs out while a save is still running raises TimeoutError and keeps
    the checkpointer open with the root's writer lock: another writer committing meanwhile
    would be outrun by the late commit (which would then delete it as an abandoned branch)."""
    root = tmp_path / "c"
    ck = resilient.Checkpointer(root, create=True, o_direct="off")
    _C.install_fault_hook(["fsync"], 0, path_contains="step-000000000001", delay_ms=1500)
    try:
        ck.save(1, {"w": torch.ones(1 << 10)})
        with pytest.raises(TimeoutError):
            ck.close(0.1)
        with pytest.raises(resilient.RootInUseError):
            resilient.Checkpointer(root, create=True)
    finally:
        _C.clear_fault_hook()
    ck.close()  # the save ends and commits; now the root is free
    with resilient.Checkpointer(root, create=True) as other:
        other.save(2, {"w": torch.ones(1 << 10)}).wait()
        assert other.lineage() == [2, 1]
