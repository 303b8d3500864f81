"""4 CPU processes (gloo) in a synchronous loop, one rank slowed by 10%, 20% and 50% of its
compute (4 ms of sleep) from step 100, plus a clean run of 2,000 steps (2 ms of sleep).
Bounded: the processes are killed after 150 s. The counts are printed (pytest -s) and
recorded in benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed not available", allow_module_level=True)

from resilient.straggler.sim import Scenario, run_world  # noqa: E402

SLOW_FROM = 100
SLOW_RANK = 2


@pytest.fixture(scope="module")
def results():
    scenarios = [Scenario("clean", 2000)] + [
        Scenario(f"slow{int(f * 100)}", 250, SLOW_RANK, f, SLOW_FROM, base_s=0.004)
        for f in (0.1, 0.2, 0.5)]
    per_rank = run_world(scenarios, world=4, timeout_s=150)
    for res in per_rank[0]:
        print(f"{res.name}: step {res.mean_step_ms:.2f} ms, first named at step "
              f"{res.first_named_step} (latency {res.detection_latency}), persistent at step "
              f"{res.first_persistent_step} since {res.since_step}, "
              f"false reports {res.false_reports} (unexplained {res.unexplained_reports})")
    return per_rank


@pytest.mark.timeout(200)
def test_clean_run_names_nobody(results):
    clean = results[0][0]
    assert clean.steps == 2000
    assert clean.first_named_step == -1
    # On a dedicated host this is 0. On a shared one the OS can really slow one rank for a while
    # (the harness's own timing shows it); naming that rank is right, so only reports the
    # harness cannot explain count against the detector.
    assert clean.unexplained_reports == 0, clean.reports


@pytest.mark.timeout(200)
@pytest.mark.parametrize("index,slowdown", [(2, 0.2), (3, 0.5)])
def test_slow_rank_named_within_50_steps(results, index, slowdown):
    res = results[0][index]
    assert res.unexplained_reports == 0, res.reports
    assert 0 <= res.detection_latency <= 50, res.reports
    assert res.named_ratio > 1.1
    # Persistent soon after, with the change point at the start of the slowdown.
    assert 0 <= res.first_persistent_step - SLOW_FROM <= 80
    assert SLOW_FROM <= res.since_step <= SLOW_FROM + 20


@pytest.mark.timeout(200)
def test_ten_percent_never_names_another_rank(results):
    # 10% is below what the defaults promise to catch quickly; it may or may not be named, but
    # no other rank may be.
    assert results[0][1].unexplained_reports == 0, results[0][1].reports


@pytest.mark.timeout(200)
def test_all_ranks_reach_the_same_verdict(results):
    for rank_results in results[1:]:
        for mine, theirs in zip(results[0], rank_results):
            assert mine.reports == theirs.reports
            assert mine.first_persistent_step >= 0 or theirs.first_persistent_step < 0
