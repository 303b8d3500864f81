"""`resilient sim ettr`: the Daly model, the interval search and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from resilient.chaos import ettr as m


def test_no_failures_leaves_only_the_checkpoint_stall():
    # M -> infinity: ETTR -> tau / (tau + delta)
    assert m.ettr(100.0, 1.0, 50.0, 1e12) == pytest.approx(100 / 101, rel=1e-6)


def test_recovery_cost_lowers_ettr_but_does_not_move_the_optimum():
    mtbf = 1.8 * 3600
    tau_a, e_a = m.best_interval(0.5, 10.0, mtbf)
    tau_b, e_b = m.best_interval(0.5, 700.0, mtbf)
    assert e_b < e_a
    assert tau_a == pytest.approx(tau_b, rel=1e-3)


def test_optimum_is_close_to_young_for_small_stalls_and_is_a_maximum():
    mtbf, delta, r = 6480.0, 0.5, 30.0
    tau, best = m.best_interval(delta, r, mtbf)
    assert tau == pytest.approx(m.young_interval(delta, mtbf), rel=0.05)
    for other in (tau / 3, tau * 0.8, tau * 1.25, tau * 3):
        assert m.ettr(other, delta, r, mtbf) < best


def test_larger_stall_means_longer_interval_and_lower_ettr():
    mtbf = 3600.0
    t1, e1 = m.best_interval(0.5, 60, mtbf)
    t2, e2 = m.best_interval(10.0, 60, mtbf)
    assert t2 > t1 and e2 < e1


def test_mtbf_scales_inversely_with_gpus():
    assert m.job_mtbf_s(1.8, 16384, 16384) == pytest.approx(1.8 * 3600)
    assert m.job_mtbf_s(1.8, 16384, 1024) == pytest.approx(16 * 1.8 * 3600)


def test_degenerate_inputs():
    assert m.ettr(0.0, 1.0, 1.0, 100.0) == 0.0
    assert m.ettr(10.0, 1.0, 1e6, 1.0) == 0.0  # recovery never completes between failures
    assert math.isfinite(m.best_interval(1.0, 1.0, 10.0)[0])


def test_cli_json_compares_the_two_paths(capsys):
    from resilient.cli import main

    assert main(["sim", "ettr", "--json", "--interval-s", "600", "--restart-stall-s", "10"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {r["name"]: r for r in rows}
    assert by["resilient"]["best_ettr"] > by["restart"]["best_ettr"]
    assert by["restart"]["best_interval_s"] > by["resilient"]["best_interval_s"]
    assert by["resilient"]["ettr_at_interval"] <= by["resilient"]["best_ettr"]


def test_costs_measured_by_chaos(tmp_path):
    doc = {"runs": [{"incidents": [
        {"fault": "kill", "detected_s": 0.2, "recovered_s": 8.2},
        {"fault": "stop", "detected_s": 1.0, "recovered_s": 11.0},
        {"fault": "eio", "detected_s": 0.1, "recovered_s": 0.0}]},
        {"recovery_path": "in-job", "incidents": [
            {"fault": "kill", "detected_s": 0.05, "recovered_s": 0.07}]}]}
    p = tmp_path / "chaos.json"
    p.write_text(json.dumps(doc))
    det, rec = m.measured_restart_costs(str(p))
    assert det == pytest.approx(0.6)
    assert rec == pytest.approx(9.0)
    p.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError):
        m.measured_restart_costs(str(p))
