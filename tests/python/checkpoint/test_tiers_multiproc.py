"""Tiered persistence to a file tier: background copies, the tier as a root of its own, its
retention, load from the fastest tier that verifies, kill -9 during each stage of a copy, and a
failing tier that leaves training and the local commits alone.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_tiers.py."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch
from test_tiers import _load, _state

from procs import kill_at_marker
from resilient.checkpoint import Checkpointer

_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from resilient.checkpoint import Checkpointer
    local, shared, pause = sys.argv[1:4]
    def state(s):
        torch.manual_seed(s)
        return {"w": torch.randn(300, 200), "b": torch.randn(77), "step": s}
    ck = Checkpointer(local, create=True, distributed=False, tiers=[shared])
    ck.save(1, state(1)).wait()
    assert ck.wait_tiers(30)
    os.environ["RESILIENT_TIER_PAUSE_AT"] = pause
    ck.save(2, state(2)).wait()
    time.sleep(120)
""")


@pytest.mark.parametrize("stage", ["file-data", "file-before-manifest", "file-before-rename",
                                   "file-after-rename"])
def test_kill_9_during_a_copy_then_the_newest_verified_step_loads(tmp_path, stage):
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    marker = str(tmp_path / "paused")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    kill_at_marker([sys.executable, str(script), local, shared, f"{stage}:{marker}"], marker,
                   60, "the copy")
    # The root has step 2; the tier has step 1, or step 2 once it was renamed into place.
    assert _load(local)[0] == 2
    step, got = _load(shared)
    assert step == (2 if stage == "file-after-rename" else 1)
    assert torch.equal(got["w"], _state(step)["w"])
    # The next run's drain finishes the copy and clears what the crash left.
    with Checkpointer(local, distributed=False, tiers=[shared]) as ck:
        ck.save(3, _state(3)).wait()
        assert ck.wait_tiers(30)
    assert _load(shared)[0] == 3
    assert not [n for n in os.listdir(shared) if n.startswith((".tmp", ".trash"))]
