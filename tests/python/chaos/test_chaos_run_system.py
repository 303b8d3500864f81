"""End-to-end chaos runs of the built-in 2-rank CPU job (bounded; the full matrix is
examples/smoke_chaos.sh): a kill recovered by restart ends bit-exact with a fault-free run and
never loads the corrupted step; a rank lost below the minimum world size ends non-zero with a
clear message."""

from __future__ import annotations

import pytest

from resilient.chaos.plan import Fault, Plan
from resilient.chaos.report import analyze
from resilient.chaos.runner import reference_plan, run_plan

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)


def test_kill_after_corrupt_recovers_bit_exact(tmp_path):
    plan = Plan(name="t-kill", ranks=2, steps=16, ckpt_every=4, step_ms=100, timeout=120,
                faults=[Fault("corrupt", at_step=9), Fault("kill", rank=1, at_step=10)])
    ref = run_plan(reference_plan(plan), tmp_path / "ref")
    assert ref.outcome == "finished", ref.message
    ref_digest = next(e["digest"] for e in ref.timeline if e["kind"] == "done")
    res = run_plan(plan, tmp_path / "run")
    rep = analyze(res, ref_digest)
    assert res.outcome == "finished", res.message
    assert rep.violations == [], rep.violations
    assert rep.bit_exact is True
    assert res.attempts == 2 and rep.recovery_path == "restart"
    kill = next(i for i in rep.incidents if i.fault == "kill")
    assert kill.detected_s is not None and kill.detected_s < 5
    assert kill.recovered_s is not None and kill.steps_lost >= 1
    assert set(kill.phases) >= {"teardown", "restart", "load", "replay"}
    assert res.corrupted == [8] and kill.loaded_step == 4  # step 8 was damaged: skipped
    assert rep.skipped == 1 and not rep.loaded_corrupt


def test_below_min_world_is_unrecoverable_with_a_message(tmp_path, capsys):
    from resilient.cli import main

    plan = tmp_path / "p.yaml"
    plan.write_text("name: lost\nranks: 2\nsteps: 30\nstep_ms: 100\nmin_world_size: 2\n"
                    "faults: [{type: kill, rank: 1, at_step: 3, permanent: true}]\n")
    rc = main(["chaos", "--plan", str(plan), "--no-compare", "--dir", str(tmp_path / "runs")])
    out = capsys.readouterr()
    assert rc != 0
    assert "fewer than the minimum world size 2" in out.out + out.err
