"""Chaos plans, the events helper, the report's arithmetic and invariants (synthetic
timelines), and the fault mechanics that need no job: file faults, corruption, duty cycle."""


from __future__ import annotations

import json
import os

import pytest

from resilient.chaos import faults as fx
from resilient.chaos.plan import Fault, Plan, load_plans, parse_fault_flag, random_faults
from resilient.chaos.report import aggregate, analyze, table
from resilient.chaos.runner import RunResult, reference_plan
from resilient.telemetry import events

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "chaos_plan.yaml")


def test_example_matrix_parses_and_states_outcomes():
    plans = load_plans(EXAMPLE)
    assert len(plans) >= 5
    assert {p.expect for p in plans} == {"recovered", "unrecoverable"}
    types = {f.type for p in plans for f in p.faults}
    assert {"kill", "stop", "slow", "eio", "enospc", "corrupt", "kill_during_save"} <= types


def test_plan_files_json_and_validation(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"name": "x", "ranks": 3, "faults": [
        {"type": "kill", "rank": 2, "at_step": 4}]}))
    (plan,) = load_plans(p)
    assert plan.ranks == 3 and plan.faults[0].rank == 2
    p.write_text(json.dumps({"ranks": 2, "faults": [{"type": "kill", "rank": 5, "at_step": 1}]}))
    with pytest.raises(ValueError, match="outside"):
        load_plans(p)
    p.write_text(json.dumps({"faults": [{"type": "meteor", "at_step": 1}]}))
    with pytest.raises(ValueError, match="unknown fault"):
        load_plans(p)
    p.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError, match="unknown plan keys"):
        load_plans(p)
    p.write_text(json.dumps({"faults": [{"type": "kill"}]}))
    with pytest.raises(ValueError, match="at_step or at_time"):
        load_plans(p)


def test_fault_flags_and_seeded_random_plans():
    f = parse_fault_flag("kill:rank=1,at_step=12,permanent")
    assert (f.type, f.rank, f.at_step, f.permanent) == ("kill", 1, 12, True)
    assert parse_fault_flag("slow:at_time=1.5,duration=2").at_time == 1.5
    plan = Plan(ranks=4, steps=40)
    a, b = random_faults(plan, 6, seed=7), random_faults(plan, 6, seed=7)
    assert a == b and len(a) == 6
    assert a != random_faults(plan, 6, seed=8)
    for f in a:
        f.validate(4)


def test_reference_plan_drops_faults_and_permanently_lost_ranks():
    plan = Plan(ranks=3, faults=[Fault("kill", rank=1, at_step=3, permanent=True)])
    ref = reference_plan(plan)
    assert ref.faults == [] and ref.ranks == 2 and plan.faults


def test_events_emit_and_tail(tmp_path, monkeypatch):
    monkeypatch.setenv(events.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(events.ENV_RANK, "2")
    tail = events.Tail(tmp_path)
    events.emit("step", step=1)
    events.emit("save_end", step=1, ok=True)
    got = tail.poll()
    assert [e["kind"] for e in got] == ["step", "save_end"] and got[0]["rank"] == 2
    with open(tmp_path / "rank-2.jsonl", "a") as f:
        f.write('{"t": 1, "kind": "torn"')  # a line cut by a kill: not returned yet
    assert tail.poll() == []
    assert [e["kind"] for e in events.read_events(tmp_path)] == ["step", "save_end"]
    monkeypatch.delenv(events.ENV_DIR)
    events.emit("step", step=2)  # no directory, no listener: nothing happens


def _tl(*items):
    return [{"t": 100.0 + t, "kind": k, "rank": r, **kw} for t, k, r, kw in items]


def _kill_timeline(load_step=10):
    return _tl(
        (0.0, "launch", "runner", {}),
        *[(1.0 + 0.1 * s, "step", 0, {"step": s, "pid": 1}) for s in range(1, 13)],
        (1.6, "save_end", 0, {"step": 5, "ok": True}),
        (2.1, "save_end", 0, {"step": 10, "ok": True}),
        (2.3, "fault", "runner", {"fault": "kill", "target": 1, "step": 12}),
        (2.4, "runner_detected", "runner", {"source": "runner:exit"}),
        (2.5, "teardown_done", "runner", {}),
        (2.6, "launch", "runner", {}),
        (4.6, "init_done", 0, {}),
        (4.8, "load", 0, {"step": load_step, "skipped": []}),
        *[(5.0 + 0.1 * i, "step", 0, {"step": load_step + 1 + i, "pid": 2})
          for i in range(20 - load_step)],
        (7.0, "done", 0, {"step": 20, "digest": "abc"}),
    )


def test_analyze_kill_restart_phases_and_ettr():
    res = RunResult(plan=Plan(name="k", steps=20), timeline=_kill_timeline(),
                    outcome="finished", committed_at_end=[5, 10, 15], verified=[5, 10, 15])
    r = analyze(res, reference_digest="abc", reference_step_s=0.1)
    (inc,) = r.incidents
    assert inc.detected_s == pytest.approx(0.1) and inc.detected_by == "runner:exit"
    assert inc.phases["teardown"] == pytest.approx(0.1)
    assert inc.phases["restart"] == pytest.approx(2.0)
    assert inc.phases["load"] == pytest.approx(0.2)
    assert inc.steps_lost == 2 and inc.loaded_step == 10
    assert inc.phases["replay"] == pytest.approx(0.3)  # step 12 again at t=5.1
    assert inc.recovered_s == pytest.approx(5.1 - 2.3)
    assert r.bit_exact is True and r.violations == []
    assert r.ettr == pytest.approx(20 * 0.1 / 7.0)
    assert "yes" in table([r])


def test_analyze_flags_corrupt_load_lost_commit_and_divergence():
    res = RunResult(plan=Plan(name="bad", steps=20), timeline=_kill_timeline(load_step=5),
                    outcome="finished", committed_at_end=[5], corrupted=[5])
    r = analyze(res, reference_digest="other")
    text = " ".join(r.violations)
    assert r.loaded_corrupt and "corrupted checkpoint was loaded" in text
    assert r.lost_committed and "step 10 was committed" in text
    assert "differs from the fault-free run" in text
    assert r.bit_exact is False


def test_analyze_expected_outcomes_and_aggregate():
    tl = _tl((0, "launch", "runner", {}),
             (1, "fault", "runner", {"fault": "kill", "target": 1, "step": 3}),
             (1.1, "runner_detected", "runner", {"source": "runner:exit"}),
             (1.2, "teardown_done", "runner", {}))
    unrec = RunResult(plan=Plan(name="u", expect="unrecoverable"), timeline=tl,
                      outcome="unrecoverable", message="1 rank(s) left")
    r1 = analyze(unrec)
    assert r1.violations == [] and r1.ettr == 0.0
    wrong = RunResult(plan=Plan(name="w"), timeline=tl, outcome="unrecoverable", message="x")
    assert any("expected recovery" in v for v in analyze(wrong).violations)
    ok = analyze(RunResult(plan=Plan(name="k", steps=20), timeline=_kill_timeline(),
                           outcome="finished", committed_at_end=[10]))
    s = aggregate([ok, r1])
    assert s["failures"] == 2 and s["auto_recovery_rate"] == 1.0  # over recoverable faults
    assert s["unrecoverable_runs"] == 1
    assert s["mttr_s"] == pytest.approx(ok.incidents[0].recovered_s)
    assert 0 < s["availability"] < 1 and s["detection_coverage"] == 1.0


def test_missed_fault_is_a_violation():
    tl = _tl((0, "launch", "runner", {}),
             (1, "fault_missed", "runner", {"describe": "kill rank 1 at step 99",
                                            "why": "the rank had already exited"}),
             (2, "done", 0, {"digest": "x"}))
    r = analyze(RunResult(plan=Plan(), timeline=tl, outcome="finished"))
    assert any("was not injected" in v for v in r.violations)


def test_file_fault_hook_fails_checkpoint_writes_only_while_armed(tmp_path):
    torch = pytest.importorskip("torch")
    from resilient import _C
    from resilient.checkpoint import Checkpointer

    trigger = tmp_path / "armed"
    _C.install_fault_hook(["write", "fsync"], 5, path_contains=str(tmp_path / "ck"),
                          trigger_file=str(trigger))
    try:
        with Checkpointer(tmp_path / "ck", keep=0) as ck:
            state = {"w": torch.arange(1000, dtype=torch.float32)}
            ck.save(1, state).wait(30)
            trigger.touch()
            with pytest.raises(OSError) as e:
                ck.save(2, state).wait(30)
            assert e.value.errno == 5
            trigger.unlink()
            ck.save(3, state).wait(30)
            assert ck.steps() == [1, 3]
        assert _C.fault_hook_hits() >= 1
    finally:
        _C.clear_fault_hook()
    with pytest.raises(ValueError):
        _C.install_fault_hook(["teleport"], 5)


def test_corrupted_newest_checkpoint_is_skipped_on_load(tmp_path):
    torch = pytest.importorskip("torch")
    from resilient.checkpoint import Checkpointer

    assert fx.corrupt_newest(tmp_path) is None
    with Checkpointer(tmp_path, keep=0) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((4096,), float(s))}).wait(30)
    assert fx.corrupt_newest(tmp_path) == 2
    state = {"w": torch.zeros(4096)}
    with Checkpointer(tmp_path, keep=0) as ck:
        assert ck.load(state) == 1
        assert [s for s, _ in ck.last_load.skipped] == [2]
    assert float(state["w"][0]) == 1.0


def test_skipped_run_is_reported_not_failed(monkeypatch, tmp_path):
    from resilient.chaos.runner import run_plan

    monkeypatch.setattr(fx.NetnsPartition, "unavailable", staticmethod(lambda: "needs root"))
    plan = Plan(name="p", ranks=3, faults=[Fault("partition", rank=2, at_step=3)])
    res = run_plan(plan, tmp_path)
    assert res.outcome == "skipped" and res.message == "needs root"
    rep = analyze(res)
    assert rep.violations == []
    assert aggregate([rep])["skipped"] == ["p"]
    assert "needs root" in table([rep])
