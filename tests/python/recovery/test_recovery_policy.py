"""Pure parts of the recovery loop: batch plans, the smaller-world policy, settings, phases."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resilient.recovery import (
    RecoveryConfig,
    Timeline,
    decide,
    phases,
    plan_batch,
    plan_whole_batches,
)


@pytest.mark.parametrize(("global_batch", "micro", "world"), list(itertools.product(
    (1, 7, 32, 64, 100), (1, 3, 8, 16), (1, 2, 3, 4, 7))))
def test_plan_covers_the_global_batch_exactly_once(global_batch: int, micro: int,
                                                   world: int) -> None:
    if global_batch < world:
        with pytest.raises(ValueError):
            plan_batch(global_batch, micro, world)
        return
    plan = plan_batch(global_batch, micro, world)
    covered = []
    for r in range(world):
        mbs = plan.micro_batches(r)
        assert 1 <= len(mbs) <= plan.accum_steps
        assert max(mb.size for mb in mbs) - min(mb.size for mb in mbs) <= 1
        for mb in mbs:
            assert 1 <= mb.size <= micro
            covered += list(range(global_batch))[mb.slice]
            # DDP divides the summed gradients by the world; each sample's weight must be 1/B.
            assert mb.loss_scale / world / mb.size == pytest.approx(1 / global_batch)
    assert covered == list(range(global_batch))  # every sample once, in order
    shares = [sum(mb.size for mb in plan.micro_batches(r)) for r in range(world)]
    assert max(shares) - min(shares) <= 1
    # As few accumulation steps as the micro-batch allows.
    assert plan.accum_steps == -(-max(shares) // micro)


def test_keep_batch_uses_accumulation_when_the_world_shrinks() -> None:
    d = decide("keep_batch", initial_world=4, world=2, min_world_size=1, global_batch=64,
               micro_batch=16)
    assert not d.stop and d.lr_factor == 1.0
    assert d.plan.accum_steps == 2 and d.plan.global_batch == 64
    assert [mb.size for mb in d.plan.micro_batches(1)] == [16, 16]
    d3 = decide("keep_batch", initial_world=4, world=3, min_world_size=1, global_batch=64,
                micro_batch=16)
    assert d3.plan.accum_steps == 2
    assert sum(mb.size for r in range(3) for mb in d3.plan.micro_batches(r)) == 64


def test_scale_lr_keeps_per_rank_batch_and_scales_lr() -> None:
    d = decide("scale_lr", initial_world=4, world=3, min_world_size=1, global_batch=64,
               micro_batch=16)
    assert d.lr_factor == pytest.approx(0.75)
    assert d.plan.global_batch == 48 and d.plan.accum_steps == 1
    assert all(mb.size == 16 for r in range(3) for mb in d.plan.micro_batches(r))
    with pytest.raises(ValueError, match="divisible"):
        decide("scale_lr", initial_world=3, world=2, min_world_size=1, global_batch=64,
               micro_batch=16)
    n = decide("none", initial_world=4, world=2, min_world_size=1, global_batch=64,
               micro_batch=16)
    assert n.lr_factor == 1.0 and n.plan.global_batch == 32


def test_below_min_world_stops_with_a_clear_message() -> None:
    d = decide("keep_batch", initial_world=8, world=5, min_world_size=6, global_batch=64,
               micro_batch=8)
    assert d.stop and d.plan is None
    assert "only 5 of 8 ranks remain" in d.message and "minimum world size 6" in d.message
    assert not decide("keep_batch", initial_world=8, world=6, min_world_size=6,
                      global_batch=64, micro_batch=8).stop
    with pytest.raises(ValueError, match="unknown recovery policy"):
        decide("grow", initial_world=2, world=1, min_world_size=1, global_batch=4, micro_batch=2)


def test_micro_batches_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError):
        plan_batch(8, 4, 2).micro_batches(2)


def test_config_env_overrides_and_setter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_RECOVERY_POLICY", "scale_lr")
    monkeypatch.setenv("RESILIENT_RECOVERY_MIN_WORLD", "3")
    monkeypatch.setenv("RESILIENT_RECOVERY_PREFER_SHRINK", "0")
    cfg = RecoveryConfig.from_env(agree_timeout_s=5)
    assert (cfg.policy, cfg.min_world, cfg.prefer_shrink, cfg.agree_timeout_s) == (
        "scale_lr", 3, False, 5.0)
    cfg.set("collective_timeout_s", "2.5")
    assert cfg.collective_timeout_s == 2.5
    for name, bad in (("policy", "grow"), ("min_world", 0), ("mismatch_source", "disk"),
                      ("poll_interval_s", 0), ("nope", 1)):
        with pytest.raises(ValueError):
            RecoveryConfig().set(name, bad)
    monkeypatch.setenv("RESILIENT_RECOVERY_POLICY", "bogus")
    with pytest.raises(ValueError):
        RecoveryConfig.from_env()


def test_phases_split_a_recovery_from_the_fault_time() -> None:
    tl = Timeline(rank=2)
    t = 100.0
    kinds = ["failure_observed", "agreed", "rebuilt", "restored", "policy", "first_collective"]
    for i, k in enumerate(kinds):
        ev = tl.add(k, cause="collective_error" if k == "failure_observed" else None,
                    source="memory", method="reinit")
        ev["time_mono"] = t + 0.1 * (i + 1)
    p = phases(tl.events, t_fault=t)
    assert p["detection_s"] == pytest.approx(0.1)
    assert p["agreement_s"] == pytest.approx(0.1)
    assert p["rebuild_s"] == pytest.approx(0.1)
    assert p["restore_s"] == pytest.approx(0.1)
    assert p["first_collective_s"] == pytest.approx(0.2)  # the policy event sits in between
    assert p["total_s"] == pytest.approx(0.6)
    assert (p["cause"], p["source"], p["method"]) == ("collective_error", "memory", "reinit")
    assert phases([], t_fault=t) == {}
    assert len(json.loads(tl.to_json())) == len(kinds)
    assert len(tl.recoveries()) == 1


def test_detector_generation_record_parses_ranges() -> None:
    from resilient.recovery.join import parse_generation_record

    assert parse_generation_record("g=3;live=0,2-4,7;removed=1:0:,5:2:step") == (3, [0, 2, 3, 4, 7])
    assert parse_generation_record("g=9;live=;removed=") == (9, [])


def test_timeline_forwards_to_the_job_event_log() -> None:
    from resilient.telemetry import events as job_events

    seen: list[dict] = []
    job_events.add_listener(seen.append)
    try:
        tl = Timeline(rank=0)
        tl.add("verdict", removed=[1], generation=1)
        tl.add("failure_observed", cause="verdict", step=5)
        for k in ("agreed", "rebuilt", "restored"):
            tl.add(k)
        tl.add("first_collective", step=5, generation=1, world_size=3)
        tl.add("stopped", reason="too few")
        tl.add("device_lost", step=7, error="CUDA error: an illegal memory access")
    finally:
        job_events.remove_listener(seen.append)
    kinds = [e["kind"] for e in seen]
    assert kinds == ["detected", "recovery_begin", "recovery_phase", "recovery_phase",
                     "recovery_phase", "recovery_phase", "recovery_end", "fatal", "fatal"]
    assert "step 7" in seen[-1]["message"] and "illegal memory access" in seen[-1]["message"]
    seen.pop()
    assert [e["phase"] for e in seen if e["kind"] == "recovery_phase"] == [
        "agreement", "rebuild", "restore", "first_collective"]
    end = seen[6]
    assert end["world_size"] == 3 and end["path"] == "in_process" and end["seconds"] >= 0
    assert seen[-1]["message"] == "too few"


def test_persistent_straggler_policy_removes_only_the_named_rank():
    from types import SimpleNamespace

    from resilient.recovery import STRAGGLER_EXIT_CODE, exclude_persistent_straggler

    exits: list[int] = []
    logs: list[str] = []
    for my_rank in range(4):
        policy = exclude_persistent_straggler(
            SimpleNamespace(rank=my_rank), exit_fn=exits.append, log=logs.append
        )
        policy(2, "compute 1.6x median since step 100")
    assert exits == [STRAGGLER_EXIT_CODE]  # only rank 2 leaves; the others carry on
    assert "rank 2" in logs[0] and "compute 1.6x" in logs[0]


@given(st.integers(1, 512), st.integers(1, 32), st.integers(1, 16))
def test_whole_batch_plans_keep_every_rank_at_one_position(global_batch: int, micro: int,
                                                           world: int) -> None:
    """Recovery(samplers=...): every rank draws the same number of whole loader batches (the
    samplers' global position stays shared), each sample weighs 1/B of the plan's own global
    batch, and that batch is the nearest whole multiple of world * micro to the one asked."""
    plan = plan_whole_batches(global_batch, micro, world)
    per_rank = {tuple(plan.sizes[r]) for r in range(world)}
    assert len(per_rank) == 1 and set(next(iter(per_rank))) == {micro}
    k = plan.accum_steps
    assert plan.global_batch == k * world * micro
    for r in range(world):
        for mb in plan.micro_batches(r):
            assert mb.loss_scale / world / mb.size == pytest.approx(1 / plan.global_batch)
    unit = world * micro
    assert k >= 1 and (k == 1 or abs(global_batch - k * unit) <= abs(global_batch - (k - 1) * unit))
    assert abs(global_batch - k * unit) <= abs(global_batch - (k + 1) * unit)


def test_keep_batch_with_a_loader_says_which_batch_it_kept() -> None:
    d = decide("keep_batch", initial_world=4, world=3, min_world_size=1, global_batch=32,
               micro_batch=8, whole_batches=True)
    assert d.plan.global_batch == 24 and d.plan.accum_steps == 1
    assert "32 -> 24 (the nearest whole number of batches of 8 per rank)" in d.message
    d = decide("keep_batch", initial_world=4, world=3, min_world_size=1, global_batch=48,
               micro_batch=4, whole_batches=True)
    assert d.plan.global_batch == 48 and "kept" in d.message
