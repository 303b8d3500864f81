"""StragglerMonitor in one process: 4 simulated ranks in lockstep with injected clocks, so the
verdicts are deterministic (the multi-process run is in test_straggler_dist.py)."""

from __future__ import annotations

import math
import random

import pytest
from resilient._C import straggler as core

from resilient.straggler import (
    LocalExchange,
    MonitorSettings,
    PrometheusExporter,
    StragglerMonitor,
    default_options,
)


class _Board:
    """Rows per window; a window's exchange completes once every rank has posted."""

    def __init__(self, world: int):
        self.world = world
        self.rows: dict[int, dict[int, list[float]]] = {}
        self.started: dict[int, int] = {}


class _Pending:
    def __init__(self, board: _Board, window: int):
        self.board, self.window = board, window

    def done(self) -> bool:
        return len(self.board.rows[self.window]) == self.board.world

    def result(self, timeout_s: float) -> list[list[float]]:
        if not self.done():
            raise TimeoutError("peers never posted")
        return [self.board.rows[self.window][r] for r in range(self.board.world)]


class _LockstepExchange:
    def __init__(self, board: _Board, rank: int):
        self.board, self.rank, self.world_size = board, rank, board.world

    def start(self, row):
        w = self.board.started.get(self.rank, 0)
        self.board.started[self.rank] = w + 1
        self.board.rows.setdefault(w, {})[self.rank] = list(row)
        return _Pending(self.board, w)


class _World:
    """`world` monitors driven through synchronous steps with fake clocks."""

    def __init__(self, world: int = 4, **monitor_kw):
        self.board = _Board(world)
        self.now = [0.0] * world
        self.reports: list[list] = [[] for _ in range(world)]
        self.hook_calls: list[list] = [[] for _ in range(world)]
        self.monitors = []
        for r in range(world):
            self.monitors.append(StragglerMonitor(
                _LockstepExchange(self.board, r), settings=MonitorSettings(cuda_events="off"),
                on_report=self.reports[r].append,
                on_persistent_straggler=lambda rank, rep, r=r: self.hook_calls[r].append(
                    (rank, rep, self.monitors[r].step_index)),
                clock=lambda r=r: self.now[r], log_rank=None, **monitor_kw))

    def step(self, compute: list[float], collective: float = 1e-4) -> None:
        slowest = max(compute)
        for r, m in enumerate(self.monitors):
            self.now[r] = max(self.now)  # steps begin together
            with m.step():
                with m.compute():
                    self.now[r] += compute[r]
                with m.wait():
                    self.now[r] += slowest - compute[r] + collective


def test_persistent_straggler_named_in_time_and_hook_called_once():
    world = _World()
    rng = random.Random(7)
    named_at = None
    for step in range(300):
        compute = [0.010 * rng.gauss(1.0, 0.02) for _ in range(4)]
        if step >= 100:
            compute[2] *= 1.2
        world.step(compute)
        if named_at is None and any(r.rank == 2 for r in world.reports[0]):
            named_at = step
    assert named_at is not None and named_at - 100 < 50, named_at
    assert {r.rank for m in world.reports for r in m} == {2}, "nobody else is named"
    for r in range(4):  # every rank reaches the same verdict and calls the hook exactly once
        assert len(world.hook_calls[r]) == 1
        rank, report, at_step = world.hook_calls[r][0]
        assert rank == 2 and report.persistent and report.since_step == 100
        assert report.phase in (core.Phase.COMPUTE, core.Phase.HOST)
        assert 1.15 < report.ratio < 1.3
        assert at_step - 100 < 60
    m = world.monitors[0]
    assert m.flush() is m.last_result  # processes the window still in flight
    assert m.persistent_ranks == {2}
    metrics = m.metrics()
    assert metrics['resilient_straggler_persistent{rank="2"}'] == 1.0
    assert metrics['resilient_straggler_persistent{rank="0"}'] == 0.0
    assert metrics["resilient_straggler_windows_total"] == 30
    assert len(m.timeline) == 30 * 4
    assert [p.rank for p in m.timeline if p.persistent] and all(
        p.rank == 2 for p in m.timeline if p.slow)


def test_clean_run_of_2000_steps_names_nobody():
    world = _World()
    rng = random.Random(11)
    for _ in range(2000):
        world.step([0.001 * rng.gauss(1.0, 0.03) for _ in range(4)])
    for m in world.monitors:
        m.flush()
    false_positives = sum(len(r) for r in world.reports)
    print(f"clean lockstep run: {false_positives} false positives in 2000 steps")
    assert false_positives == 0
    assert world.monitors[0].detector.windows == 200


def test_straggler_recovers_and_policy_hook_not_repeated():
    world = _World()
    for step in range(400):
        compute = [0.01] * 4
        if 50 <= step < 150:
            compute[1] = 0.015
        world.step(compute)
    assert len(world.hook_calls[0]) == 1
    assert world.monitors[0].persistent_ranks == set(), "rank 1 recovered"
    assert not math.isnan(world.monitors[0].last_result.scores[1].ratio)


def test_prometheus_exporter_sets_gauges():
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    world = _World()
    exporter = PrometheusExporter(world.monitors[0], registry=registry)
    for _ in range(61):  # the 6th window's exchange is processed at the step after it
        world.step([0.01, 0.01, 0.02, 0.01])
    assert registry.get_sample_value("resilient_straggler_persistent", {"rank": "2"}) == 1.0
    assert registry.get_sample_value("resilient_straggler_ratio", {"rank": "2"}) == pytest.approx(
        2.0, rel=0.05)
    assert registry.get_sample_value("resilient_straggler_windows") == 6
    assert exporter.gauges["slow"].labels("0")._value.get() == 0.0


def test_exchange_not_done_is_waited_at_next_window_with_deadline():
    class NeverDone:
        rank, world_size = 0, 1

        def start(self, row):
            return self

        def done(self):
            return False

        def result(self, timeout_s):
            raise TimeoutError(f"after {timeout_s}s")

    t = [0.0]
    m = StragglerMonitor(NeverDone(), settings=MonitorSettings(exchange_timeout_s=0.5,
                                                               cuda_events="off"),
                         clock=lambda: t[0])
    for _ in range(10):  # the first window's exchange starts; the monitor does not block
        m.step_begin()
        t[0] += 0.01
        m.step_end()
    with pytest.raises(TimeoutError, match="0.5"):
        for _ in range(10):
            m.step_begin()
            m.step_end()


def test_single_rank_default_exchange_and_misuse():
    m = StragglerMonitor(settings=MonitorSettings(cuda_events="off"))
    assert isinstance(m.exchange, LocalExchange) and m.world_size == 1
    for _ in range(25):
        with m.step():
            pass
    assert m.detector.windows == 2 and m.last_result.reports == []
    with pytest.raises(RuntimeError, match="without step_begin"):
        m.step_end()


def test_options_and_settings_from_environment(monkeypatch):
    monkeypatch.setenv("RESILIENT_STRAGGLER_INTERVAL", "7")
    monkeypatch.setenv("RESILIENT_STRAGGLER_REPORT_AFTER", "2")
    opts = default_options()
    assert opts.interval == 7 and opts.report_after == 2
    m = StragglerMonitor(settings=MonitorSettings(cuda_events="off"))
    assert m.options.interval == 7
    monkeypatch.setenv("RESILIENT_STRAGGLER_MIN_RATIO", "fast")
    with pytest.raises(ValueError, match="RESILIENT_STRAGGLER_MIN_RATIO"):
        default_options()
    monkeypatch.setenv("RESILIENT_STRAGGLER_EXCHANGE_TIMEOUT_S", "3")
    monkeypatch.setenv("RESILIENT_STRAGGLER_CUDA_EVENTS", "OFF")
    s = MonitorSettings()
    assert s.exchange_timeout_s == 3.0 and s.cuda_events == "off"
    monkeypatch.setenv("RESILIENT_STRAGGLER_CUDA_EVENTS", "maybe")
    with pytest.raises(ValueError):
        MonitorSettings()


def test_invalid_options_and_rows_raise_value_error():
    opts = core.StragglerOptions()
    opts.slow_ratio = 1.01
    with pytest.raises(ValueError, match="slow_ratio"):
        opts.validate()
    with pytest.raises(ValueError):
        StragglerMonitor(options=opts)
    det = core.StragglerDetector(core.StragglerOptions(), 2)
    with pytest.raises(ValueError, match="expected"):
        det.update(0, 9, [[10, 0.01, 0.01], [10, 0.01, 0.01]])
    with pytest.raises(ValueError, match="detector expects 2"):
        det.update(0, 9, [[10, 0.01, 0.01, 0.01, 0.0]])
    with pytest.raises(IndexError):
        det.cusum(5)


def test_cuda_events_on_without_cuda_is_unavailable():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the 'on' path is exercised by the CUDA benchmark")
    from resilient.errors import UnavailableError

    with pytest.raises(UnavailableError):
        StragglerMonitor(settings=MonitorSettings(cuda_events="on"))


def test_statistics_bindings():
    assert core.median([3.0, 1.0, 2.0, float("nan")]) == 2.0
    assert core.mad([1.0, 2.0, 3.0, 4.0, 100.0], 3.0) == 1.0
    assert core.summarize([1.0, 2.0, 3.0]) == (2.0, 1.0, 3)


def test_harness_explains_a_report_by_any_of_its_windows() -> None:
    """The distributed test's harness counts a report on a rank as explained when its own timing
    saw that rank slow in one of the report's windows (since_step..last_step), not elsewhere."""
    import torch

    from resilient.straggler.sim import _really_slow

    busy = [torch.full((400,), 1.0, dtype=torch.float64) for _ in range(4)]
    busy[2][100:200] = 1.3  # rank 2 slow in steps 100-199 only
    assert _really_slow(busy, 2, since=100, last=399, interval=100, min_ratio=1.1)
    assert not _really_slow(busy, 2, since=200, last=399, interval=100, min_ratio=1.1)
    assert not _really_slow(busy, 2, since=-1, last=399, interval=100, min_ratio=1.1)
    assert _really_slow(busy, 2, since=-1, last=199, interval=100, min_ratio=1.1)
    assert not _really_slow(busy, 1, since=0, last=399, interval=100, min_ratio=1.1)


def test_a_group_replaced_by_recovery_starts_the_windows_over():
    """An exchange that follows the default group (TorchExchange(group=None)) says when
    in-process recovery replaced it: the summary in flight over the old group is dropped, not
    waited for, and the detector starts over with the new group's ranks."""

    class Shrinking:
        rank, world_size = 1, 3
        replaced = False

        def refresh(self):
            if self.replaced and self.world_size == 3:
                self.rank, self.world_size = 0, 2
                return True
            return False

        def start(self, row):
            return self

        def done(self):
            return self.world_size == 3 and False  # the old group's gather never completes

        def result(self, timeout_s):
            raise AssertionError("the old group's summary is never waited for")

    t = [0.0]
    ex = Shrinking()
    m = StragglerMonitor(ex, settings=MonitorSettings(cuda_events="off"), clock=lambda: t[0])
    interval = int(m.options.interval)
    for _ in range(interval):  # the first window's exchange is in flight
        m.step_begin()
        t[0] += 0.01
        m.step_end()
    assert m._pending is not None
    ex.replaced = True  # Recovery rebuilt the group over 2 ranks
    m.step_begin()
    m.step_end()
    assert (m.rank, m.world_size) == (0, 2) and m._pending is None
    assert m.detector.world_size == 2
