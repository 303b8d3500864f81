"""4 CPU processes (gloo) in a synchronous loop, one rank slowed by 10%, 20% and 50% of its
compute (10 ms of sleep) from step 100, plus a clean run of 2,000 steps (2 ms of sleep). The
slowed runs use 10 ms rather than a few: on a loaded 2-core CI host the scheduler's jitter is
about a millisecond, which would otherwise be as large as the 20% signal.
Bounded: the processes are killed after 150 s. The counts are printed (pytest -s) and
recorded in benchmarks/RESULTS.md."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.alone  # latencies in steps: run alone (scripts/test.sh)

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed not available", allow_module_level=True)

import machine  # noqa: E402
from resilient.straggler.sim import Scenario, run_world  # noqa: E402
from tiers import STARVED  # noqa: E402


class Results(list):
    starved: float | None = None

SLOW_FROM = 100
SLOW_RANK = 2


#: Runs of the world at most: one more when a run's processes waited for a CPU most of the time.
ATTEMPTS = 2


@pytest.fixture(scope="module")
def results():
    """Every rank's results; the run is made again when the machine's tasks waited for a CPU
    most of its time (the latency in steps measures the detector on a machine that gives the
    ranks their CPU: starved, the noise it must ride out is the machine's). `starved` on the
    results: the share of the last run's time spent waiting, when even that run was starved."""
    scenarios = [Scenario("clean", 2000)] + [
        Scenario(f"slow{int(f * 100)}", 250, SLOW_RANK, f, SLOW_FROM, base_s=0.010)
        for f in (0.1, 0.2, 0.5)]
    for _ in range(ATTEMPTS):
        before, t0 = machine.stall_counter(), time.monotonic()
        per_rank = run_world(scenarios, world=4, timeout_s=150)
        share = machine.stall_share(before, machine.stall_counter(), time.monotonic() - t0)
        print(f"the machine's tasks waited for a CPU {share if share is None else f'{share:.0%}'}"
              f" of the run")
        if share is None or share < STARVED:
            break
    per_rank = Results(per_rank)
    per_rank.starved = share if share is not None and share >= STARVED else None
    for res in per_rank[0]:
        print(f"{res.name}: step {res.mean_step_ms:.2f} ms, first named at step "
              f"{res.first_named_step} (latency {res.detection_latency}), persistent at step "
              f"{res.first_persistent_step} since {res.since_step}, "
              f"false reports {res.false_reports} (unexplained {res.unexplained_reports})")
    return per_rank


def _summary(res) -> str:
    """Everything a failure needs to be understood from a CI log alone."""
    return (f"{res.name}: step {res.mean_step_ms:.2f} ms, named at {res.first_named_step} "
            f"(ratio {res.named_ratio:.3f}), persistent at {res.first_persistent_step} since "
            f"{res.since_step}, false {res.false_reports} (unexplained "
            f"{res.unexplained_reports}); reports {res.reports}")


@pytest.mark.timeout(200)
def test_clean_run_names_nobody(results):
    clean = results[0][0]
    assert clean.steps == 2000
    assert clean.first_named_step == -1
    # On a dedicated host this is 0. On a shared one the OS can really slow one rank for a while
    # (the harness's own timing shows it); naming that rank is right, so only reports the
    # harness cannot explain count against the detector.
    assert clean.unexplained_reports == 0, _summary(clean)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("index,slowdown", [(2, 0.2), (3, 0.5)])
def test_slow_rank_named_within_50_steps(results, index, slowdown):
    res = results[0][index]
    seen = _summary(res)
    assert res.unexplained_reports == 0, seen
    if results.starved is not None and not 0 <= res.detection_latency <= 50:
        pytest.fail(f"CPU-STARVED: the ranks waited for a CPU {results.starved:.0%} of both runs "
                    f"(the latency in steps follows the machine's noise): {seen}", pytrace=False)
    assert 0 <= res.detection_latency <= 50, seen
    assert res.named_ratio > 1.1, seen
    # Persistent soon after, with the change point at the start of the slowdown.
    assert 0 <= res.first_persistent_step - SLOW_FROM <= 80, seen
    assert SLOW_FROM <= res.since_step <= SLOW_FROM + 20, seen


@pytest.mark.timeout(200)
def test_ten_percent_never_names_another_rank(results):
    # 10% is below what the defaults promise to catch quickly; it may or may not be named, but
    # no other rank may be.
    assert results[0][1].unexplained_reports == 0, _summary(results[0][1])


@pytest.mark.timeout(200)
def test_all_ranks_reach_the_same_verdict(results):
    for rank_results in results[1:]:
        for mine, theirs in zip(results[0], rank_results):
            assert mine.reports == theirs.reports
            assert mine.first_persistent_step >= 0 or theirs.first_persistent_step < 0
