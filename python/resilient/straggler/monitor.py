"""StragglerMonitor: per-step timings in the training loop, cross-rank verdicts every K steps.

Usage (every rank)::

    monitor = StragglerMonitor(on_persistent_straggler=lambda rank, report: ...)
    for batch in loader:
        with monitor.step():
            with monitor.compute():
                loss = model(batch); loss.backward()
            with monitor.wait():
                all_reduce_gradients()
            optimizer.step()

Per step the monitor records host timestamps (perf_counter) and, with CUDA, an event pair around
the compute region that is resolved later without synchronising. Phases: compute (GPU time, or host
time of the compute region without CUDA), wait (host time in collectives: in synchronous training
the straggler is the rank that waits least) and host (step wall time minus wait). Every `interval`
steps each rank summarises its window by per-phase medians and starts one asynchronous exchange
of those five numbers; when it has arrived (usually at the next step) every rank feeds the same
matrix to its native StragglerDetector, so all ranks agree on the verdict without another exchange.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from resilient._C import straggler as _core
from resilient.straggler.exchange import LocalExchange, PendingRows, SummaryExchange
from resilient.straggler.settings import MonitorSettings, StragglerOptions, default_options

logger = logging.getLogger("resilient.straggler")

StragglerReport = _core.StragglerReport
WindowResult = _core.WindowResult
Phase = _core.Phase

_NAN = float("nan")


@dataclass(frozen=True)
class TimelinePoint:
    """One rank's score in one window (the per-rank score timeline)."""

    window: int
    last_step: int
    rank: int
    phase: str
    ratio: float
    z: float
    slow: bool
    persistent: bool
    cusum: float


class _Region:
    """A reusable context manager that calls begin/end (cheaper than contextlib per step)."""

    __slots__ = ("_begin", "_end")

    def __init__(self, begin: Callable[[], None], end: Callable[[], None]):
        self._begin = begin
        self._end = end

    def __enter__(self) -> None:
        self._begin()

    def __exit__(self, *exc) -> None:
        self._end()


def _median(values: list[float]) -> float:
    return _core.median(values) if values else _NAN


class StragglerMonitor:
    """Measures each step and names stragglers across ranks.

    Args:
        exchange: how summaries reach every rank; default TorchExchange() when torch.distributed
            is initialized, else a single-rank LocalExchange.
        options: detector options (default: default_options(), i.e. RESILIENT_STRAGGLER_*).
        settings: monitor settings (default: MonitorSettings()).
        on_window: called with every WindowResult (all ranks' scores), e.g. for a timeline.
        on_report: called with each StragglerReport of a window.
        on_persistent_straggler: policy hook, called once per excursion with (rank, report) when a
            rank turns persistent; a recovery loop can use it to exclude the rank.
        log_rank: the rank that logs verdicts (None: every rank).
        clock: seconds as float (injectable for tests).
        timeline_len: windows of per-rank scores kept in `timeline`.

    Callbacks run on every rank, in the training thread, after the step that completed the
    exchange. Not thread-safe: use one monitor per training loop.
    """

    def __init__(self, exchange: SummaryExchange | None = None,
                 options: StragglerOptions | None = None,
                 settings: MonitorSettings | None = None, *,
                 on_window: Callable[[WindowResult], None] | None = None,
                 on_report: Callable[[StragglerReport], None] | None = None,
                 on_persistent_straggler: Callable[[int, StragglerReport], None] | None = None,
                 log_rank: int | None = 0,
                 clock: Callable[[], float] = time.perf_counter,
                 timeline_len: int = 10_000):
        self.options = options if options is not None else default_options()
        self.options.validate()
        self.settings = settings or MonitorSettings()
        self.settings.validate()
        self.exchange = exchange if exchange is not None else _default_exchange()
        self.rank = self.exchange.rank
        self.world_size = self.exchange.world_size
        self._detector = _core.StragglerDetector(self.options, self.world_size)
        self._interval = int(self.options.interval)
        self.on_window = on_window
        self.on_report = on_report
        self.on_persistent_straggler = on_persistent_straggler
        self._log_here = log_rank is None or log_rank == self.rank
        self._clock = clock
        self._gpu = _make_gpu_timer(self.settings.cuda_events)

        self.step_index = 0  # index of the next step to begin
        self._window_first = 0
        self._samples: list[list[float]] = [[], [], [], []]  # step, compute, host, wait
        self._step_t0: float | None = None
        self._wait_s = 0.0
        self._wait_t0 = 0.0
        self._compute_s = _NAN
        self._compute_t0 = 0.0
        self._pending: tuple[int, int, PendingRows] | None = None

        self.last_result: WindowResult | None = None
        self.timeline: deque[TimelinePoint] = deque(maxlen=timeline_len)
        self.reports_total = 0
        self.persistent_ranks: set[int] = set()
        self._named: set[int] = set()

        self._step_region = _Region(self.step_begin, self.step_end)
        self._compute_region = _Region(self.compute_begin, self.compute_end)
        self._wait_region = _Region(self.wait_begin, self.wait_end)

    # ---- per-step API -------------------------------------------------------------------

    def step(self) -> _Region:
        """Context manager around one training step (step_begin/step_end)."""
        return self._step_region

    def compute(self) -> _Region:
        """Context manager around the step's compute (forward/backward)."""
        return self._compute_region

    def wait(self) -> _Region:
        """Context manager around a blocking collective (or any wait for peers)."""
        return self._wait_region

    def step_begin(self) -> None:
        """Marks the start of a step."""
        self._step_t0 = self._clock()
        self._wait_s = 0.0
        self._compute_s = _NAN

    def compute_begin(self) -> None:
        if self._gpu is not None:
            self._gpu.begin()
        else:
            self._compute_t0 = self._clock()

    def compute_end(self) -> None:
        if self._gpu is not None:
            self._gpu.end()
        else:
            elapsed = self._clock() - self._compute_t0
            self._compute_s = elapsed if math.isnan(self._compute_s) else self._compute_s + elapsed

    def wait_begin(self) -> None:
        self._wait_t0 = self._clock()

    def wait_end(self) -> None:
        self._wait_s += self._clock() - self._wait_t0

    def add_wait(self, seconds: float) -> None:
        """Adds wait time measured by the caller (e.g. a hook around work.wait())."""
        self._wait_s += seconds

    def all_reduce(self, tensor, *args, **kwargs):
        """torch.distributed.all_reduce, with its host time counted as wait."""
        import torch.distributed as dist

        with self._wait_region:
            return dist.all_reduce(tensor, *args, **kwargs)

    def step_end(self) -> None:
        """Marks the end of a step; every `interval` steps starts the summary exchange."""
        if self._step_t0 is None:
            raise RuntimeError("step_end() without step_begin()")
        step_s = self._clock() - self._step_t0
        self._step_t0 = None
        s = self._samples
        s[0].append(step_s)
        if self._gpu is None:
            s[1].append(self._compute_s)
        else:
            s[1].extend(self._gpu.poll())
        s[2].append(step_s - self._wait_s)
        s[3].append(self._wait_s)
        self.step_index += 1
        self._follow_world()
        if self._pending is not None and self._pending[2].done():
            self._finish_exchange()
        if self.step_index - self._window_first >= self._interval:
            self._start_exchange()

    # ---- aggregation --------------------------------------------------------------------

    def _follow_world(self) -> None:
        """After in-process recovery changed the group (the exchange follows it): the summary
        in flight over the old group is dropped, and the windows start over with the new ranks
        (their numbers changed, so no rank's history carries over)."""
        refresh = getattr(self.exchange, "refresh", None)
        if refresh is None or not refresh():
            return
        logger.info("straggler monitor: the group changed (world %d -> %d); windows start over",
                    self.world_size, self.exchange.world_size)
        self._pending = None
        self.rank = self.exchange.rank
        self.world_size = self.exchange.world_size
        self._detector = _core.StragglerDetector(self.options, self.world_size)
        self.persistent_ranks = set()
        self._named = set()
        self._samples = [[], [], [], []]
        self._window_first = self.step_index

    def _start_exchange(self) -> None:
        if self._pending is not None:  # the previous window has had a whole window to arrive
            self._finish_exchange()
        s = self._samples
        compute = [x for x in s[1] if not math.isnan(x)]
        row = [float(len(s[0])), _median(s[0]), _median(compute), _median(s[2]), _median(s[3])]
        first, last = self._window_first, self.step_index - 1
        self._samples = [[], [], [], []]
        self._window_first = self.step_index
        self._pending = (first, last, self.exchange.start(row))

    def _finish_exchange(self) -> None:
        first, last, pending = self._pending
        self._pending = None
        rows = pending.result(self.settings.exchange_timeout_s)
        self._handle(self._detector.update(first, last, rows))

    def flush(self) -> WindowResult | None:
        """Waits (with the exchange deadline) for the summary in flight and processes it."""
        if self._pending is not None:
            self._finish_exchange()
        return self.last_result

    def _handle(self, result: WindowResult) -> None:
        self.last_result = result
        for sc in result.scores:
            self.timeline.append(TimelinePoint(
                result.window, result.last_step, sc.rank, _core.phase_name(sc.worst_phase),
                sc.ratio, sc.z, sc.slow, sc.persistent, sc.cusum))
        if self.on_window is not None:
            self.on_window(result)
        by_rank = {r.rank: r for r in result.reports}
        for rank in result.recovered:
            self.persistent_ranks.discard(rank)
            if self._log_here:
                logger.warning("straggler: rank %d recovered at step %d", rank, result.last_step)
        for rank in list(self._named):
            if rank not in by_rank:
                self._named.discard(rank)
        for report in result.reports:
            self.reports_total += 1
            if report.rank not in self._named and self._log_here:
                logger.warning("straggler: %s", report)
            self._named.add(report.rank)
            if self.on_report is not None:
                self.on_report(report)
        for rank in result.newly_persistent:
            self.persistent_ranks.add(rank)
            report = by_rank[rank]
            if self._log_here:
                logger.error("straggler: %s", report)
            if self.on_persistent_straggler is not None:
                self.on_persistent_straggler(rank, report)

    # ---- state for metrics ---------------------------------------------------------------

    @property
    def detector(self):
        """The native StragglerDetector (read its cusum(rank) state, windows, options)."""
        return self._detector

    def metrics(self) -> dict[str, float]:
        """Latest values as Prometheus-style sample names, e.g.
        'resilient_straggler_ratio{rank="2"}' -> 1.21. Empty until the first window."""
        out: dict[str, float] = {
            "resilient_straggler_windows_total": float(self._detector.windows),
            "resilient_straggler_reports_total": float(self.reports_total),
        }
        if self.last_result is None:
            return out
        for sc in self.last_result.scores:
            label = f'{{rank="{sc.rank}"}}'
            out[f"resilient_straggler_ratio{label}"] = sc.ratio
            out[f"resilient_straggler_zscore{label}"] = sc.z
            out[f"resilient_straggler_cusum{label}"] = sc.cusum
            out[f"resilient_straggler_slow{label}"] = float(sc.slow)
            out[f"resilient_straggler_persistent{label}"] = float(sc.persistent)
        return out


def _default_exchange() -> SummaryExchange:
    try:
        import torch.distributed as dist
    except ImportError:
        return LocalExchange()
    if dist.is_available() and dist.is_initialized():
        from resilient.straggler.exchange import TorchExchange

        return TorchExchange()
    return LocalExchange()


def _make_gpu_timer(mode: str):
    if mode == "off":
        return None
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        if mode == "on":
            from resilient.errors import UnavailableError

            raise UnavailableError("RESILIENT_STRAGGLER_CUDA_EVENTS=on but CUDA is not available")
        logger.info("straggler: CUDA not available, timing compute on the host")
        return None
    from resilient.straggler.timers import CudaEventTimer

    return CudaEventTimer()
