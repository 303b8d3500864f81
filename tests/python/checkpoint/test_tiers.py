"""Tiered persistence to a file tier: background copies, the tier as a root of its own, its
retention, load from the fastest tier that verifies, kill -9 during each stage of a copy, and a
failing tier that leaves training and the local commits alone."""


from __future__ import annotations

import json
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from damage import flip_byte
from resilient.checkpoint import Checkpointer
from resilient.checkpoint import root as roots
from resilient.checkpoint.tiers import FileTier, read_status
from resilient.errors import ResilientError


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(300, 200), "b": torch.randn(77), "step": seed}


def _load(root: str, **kw) -> tuple[int | None, dict]:
    target = {"w": torch.zeros(300, 200), "b": torch.zeros(77), "step": 0}
    with Checkpointer(root, distributed=False, **kw) as ck:
        step = ck.load(target)
    return step, target


def _steps(path: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(path) if n.startswith("step-"))


def test_steps_drain_to_the_tier_which_is_a_root_with_its_own_retention(tmp_path):
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with Checkpointer(local, keep=2, create=True, distributed=False,
                      tiers=[FileTier(shared, keep=3)]) as ck:
        for s in range(1, 6):
            ck.save(s, _state(s)).wait()
            assert ck.wait_tiers(30)
        status = ck.tier_status()
    assert _steps(local) == [4, 5]
    assert _steps(shared) == [3, 4, 5]
    assert status[0]["steps"] == [3, 4, 5] and status[0]["error"] is None
    assert read_status(local)["tiers"][0]["url"] == shared
    assert not [n for n in os.listdir(shared) if n.startswith((".tmp", ".trash"))]
    # The tier loads on its own, with its own lineage (newest first) and verified data.
    with Checkpointer(shared, distributed=False) as ck:
        assert ck.lineage() == [5, 4, 3]
        for s in (3, 4, 5):
            ck.verify(s)
    step, got = _load(shared)
    assert step == 5 and torch.equal(got["w"], _state(5)["w"]) and got["step"] == 5


def test_a_fresh_node_loads_the_newest_step_from_the_tier(tmp_path):
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with Checkpointer(local, create=True, distributed=False, tiers=[shared]) as ck:
        for s in (10, 20):
            ck.save(s, _state(s)).wait()
    os.rename(local, str(tmp_path / "lost"))  # the node's local disk is gone
    step, got = _load(local, tiers=[shared])
    assert step == 20 and torch.equal(got["b"], _state(20)["b"])
    assert _steps(local) == [20]
    # The next commit continues the lineage after the fetched step.
    with Checkpointer(local, distributed=False, tiers=[shared]) as ck:
        ck.load({"w": torch.zeros(300, 200), "b": torch.zeros(77), "step": 0})
        ck.save(30, _state(30)).wait()
        assert ck.wait_tiers(30)
        assert ck.lineage() == [30, 20]
    with Checkpointer(shared, distributed=False) as ck:
        assert ck.lineage()[:2] == [30, 20]


def test_a_corrupt_local_copy_is_replaced_by_the_tiers_and_the_same_step_loads(tmp_path):
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with Checkpointer(local, create=True, distributed=False, tiers=[shared]) as ck:
        for s in (1, 2):
            ck.save(s, _state(s)).wait()
    data = os.path.join(roots.step_dir(local, 2), "rank-00000.data")
    flip_byte(data, 100)
    step, got = _load(local, tiers=[shared])
    assert step == 2 and torch.equal(got["w"], _state(2)["w"])
    # Without the tier, the same flip would have fallen back to step 1.
    flip_byte(data, 100)
    step, _ = _load(local)
    assert step == 1


def test_a_failing_tier_leaves_saves_and_local_retention_alone(tmp_path):
    local = str(tmp_path / "local")
    blocked = tmp_path / "file"
    blocked.write_text("a file where the tier's directory would be")
    bad = str(blocked / "tier")
    with Checkpointer(local, keep=2, create=True, distributed=False, tiers=[bad]) as ck:
        for s in range(1, 6):
            ck.save(s, _state(s)).wait()
        ck.wait_cleanup(30)
        deadline = time.monotonic() + 10
        while not ck.tier_status()[0]["failures"] and time.monotonic() < deadline:
            time.sleep(0.05)
        status = ck.tier_status()[0]
        assert status["failures"] >= 1 and "does not exist" in status["error"]
        assert status["pending"] == 5 or status["copying"] == 5
        # The step waiting for the tier is kept; older ones are deleted as usual.
        assert _steps(local) == [4, 5]
        assert not ck.wait_tiers(0.2)
    step, _ = _load(local)
    assert step == 5


def test_a_root_that_starts_afresh_without_loading_is_not_copied_over_a_newer_tier(tmp_path):
    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    with Checkpointer(local, create=True, distributed=False, tiers=[shared]) as ck:
        for s in (1, 2):
            ck.save(s, _state(s)).wait()
        assert ck.wait_tiers(30)
    os.rename(local, str(tmp_path / "lost"))
    with Checkpointer(local, create=True, distributed=False, tiers=[shared]) as ck:
        ck.save(1, _state(9)).wait()  # no load(): its commit is older than the tier's
        deadline = time.monotonic() + 10
        while not ck.tier_status()[0]["failures"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "another root writes to this tier" in ck.tier_status()[0]["error"]
    step, got = _load(shared)
    assert step == 2 and torch.equal(got["w"], _state(2)["w"])


def test_an_unreachable_tier_with_an_empty_root_is_an_error_not_a_fresh_start(tmp_path):
    local = str(tmp_path / "local")
    with pytest.raises(ResilientError, match="cannot be listed"):
        _load(local, create=True, tiers=[str(tmp_path / "unmounted" / "ckpt")])
    (tmp_path / "first-run").mkdir()  # a tier that does not exist yet: a first run
    assert _load(local, create=True, tiers=[str(tmp_path / "first-run" / "ckpt")])[0] is None
    # Draining never creates the missing parent (copies would land on the local disk).
    with Checkpointer(local, create=True, distributed=False,
                      tiers=[str(tmp_path / "unmounted" / "ckpt")]) as ck:
        ck.save(1, _state(1)).wait()
        deadline = time.monotonic() + 10
        while not ck.tier_status()[0]["failures"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "not mounted" in ck.tier_status()[0]["error"]
    assert not (tmp_path / "unmounted").exists()


def test_a_tier_that_is_the_root_or_a_bad_url_is_refused(tmp_path):
    local = str(tmp_path / "local")
    with pytest.raises(ValueError, match="checkpoint root itself"):
        Checkpointer(local, create=True, distributed=False, tiers=[local])
    with pytest.raises(ValueError, match="unsupported tier URL"):
        Checkpointer(local, create=True, distributed=False, tiers=["gs://bucket/x"])


def test_ckpt_ls_shows_which_tiers_hold_each_step(tmp_path, capsys):
    from resilient.cli import main

    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with Checkpointer(local, keep=3, create=True, distributed=False,
                      tiers=[FileTier(shared, keep=1), str(blocked / "tier")]) as ck:
        for s in (1, 2):
            ck.save(s, _state(s)).wait()
            ck.wait_tiers(0.0)
        deadline = time.monotonic() + 10
        while not (ck.tier_status()[1]["failures"] and ck.tier_status()[0]["steps"] == [2]):
            assert time.monotonic() < deadline, ck.tier_status()
            time.sleep(0.05)
    capsys.readouterr()
    assert main(["ckpt", "ls", local, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["tiers"] for s in doc["steps"]] == [[], [shared]]
    assert doc["tiers"][0]["url"] == shared and "does not exist" in doc["tiers"][1]["error"]
    assert main(["ckpt", "ls", local]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "TIERS" in lines[1]
    assert lines[2].split()[-1] == "root" and lines[3].split()[-1] == "root,1"
    assert f"tier 1: {shared} (up to date)" in out
    assert f"tier 2: {blocked / 'tier'}" in out and "does not exist" in out


def test_tier_metrics_show_progress_and_failures(tmp_path):
    from resilient.telemetry.metrics import RankMetrics

    local, shared = str(tmp_path / "local"), str(tmp_path / "shared")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    bad = str(blocked / "tier")
    with Checkpointer(local, create=True, distributed=False, tiers=[shared, bad]) as ck:
        m = RankMetrics(0)
        m.attach_tiers(ck)
        ck.save(7, _state(7)).wait()
        deadline = time.monotonic() + 10
        while not (ck.tier_status()[1]["failures"] and ck.tier_status()[0]["steps"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        text = m.text()
    assert f'resilient_tier_newest_step{{rank="0",tier="{shared}"}} 7.0' in text
    assert f'resilient_tier_pending{{rank="0",tier="{shared}"}} 0.0' in text
    assert f'resilient_tier_failing{{rank="0",tier="{bad}"}} 1.0' in text
    assert f'resilient_tier_pending{{rank="0",tier="{bad}"}} 1.0' in text
    assert f'resilient_tier_newest_step{{rank="0",tier="{bad}"}} -1.0' in text
    assert f'resilient_tier_failures_total{{rank="0",tier="{bad}"}}' in text
    assert f'resilient_tier_bytes_total{{rank="0",tier="{shared}"}} 0.0' not in text


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(st.just(("save",)), st.tuples(st.just("rollback"), st.integers(0, 5)),
                              st.just(("wipe",)), st.just(("corrupt",))), min_size=1, max_size=8),
       keep=st.integers(1, 3), tier_keep=st.integers(1, 3))
def test_any_history_leaves_the_tier_with_the_roots_head_and_loads_restore_it(
        tmp_path_factory, ops, keep, tier_keep):
    """Saves, rollbacks (load(step=k) then save), a wiped local root and a corrupted newest
    local step, in any order: after the tier caught up it holds the root's newest commit,
    at most `tier_keep` steps of its own lineage, and a load with the tier restores the newest
    commit's exact data."""
    base = tmp_path_factory.mktemp("prop")
    local, shared = str(base / "local"), str(base / "shared")
    step, saved, seed = 0, {}, 0  # saved: step -> seed of its newest commit's data
    head: int | None = None
    for op in ops:
        if op[0] == "save":  # a (re)started run: load (CheckpointManager.restore), then save
            target = {"w": torch.zeros(300, 200), "b": torch.zeros(77), "step": 0}
            with Checkpointer(local, keep=keep, create=True, distributed=False,
                              tiers=[FileTier(shared, keep=tier_keep)]) as ck:
                assert ck.load(target) == head
                step, seed = step + 1, seed + 1
                ck.save(step, _state(seed)).wait()
                assert ck.wait_tiers(10)
            saved[step], head = seed, step
        elif op[0] == "rollback" and head is not None:
            with Checkpointer(local, keep=keep, distributed=False, tiers=[shared]) as ck:
                have = ck.lineage() or [head]
            k = have[min(op[1], len(have) - 1)]
            target = {"w": torch.zeros(300, 200), "b": torch.zeros(77), "step": 0}
            step, seed = k + 1, seed + 1  # the same step numbers again, on a new branch
            with Checkpointer(local, keep=keep, distributed=False,
                              tiers=[FileTier(shared, keep=tier_keep)]) as ck:
                assert ck.load(target, step=k) == k
                assert torch.equal(target["w"], _state(saved[k])["w"])
                ck.save(step, _state(seed)).wait()
                assert ck.wait_tiers(10)
            saved[step], head = seed, step
        elif op[0] == "wipe" and os.path.isdir(local):
            os.rename(local, str(base / f"wiped-{time.monotonic_ns()}"))
        elif op[0] == "corrupt" and head is not None and os.path.isdir(
                roots.step_dir(local, head)):
            flip_byte(os.path.join(roots.step_dir(local, head), "rank-00000.data"), 64, 1)
    if head is None:
        return
    with Checkpointer(shared, distributed=False) as ck:
        assert ck.lineage()[0] == head and len(ck.steps()) <= tier_keep
    step_loaded, got = _load(local, tiers=[shared])
    assert step_loaded == head and torch.equal(got["w"], _state(saved[head])["w"])
