"""A Prometheus endpoint per rank (prometheus_client): checkpoint stall, bytes, throughput and
age of the last durable checkpoint, recoveries, plus the detector's heartbeat RTTs, suspicion
(phi) and membership generation, and the straggler scores, each fed by that component's own
exporter or by the job's events (resilient.telemetry.events).

Example::

    m = RankMetrics(rank)                    # its own CollectorRegistry
    m.attach_detector(detector)              # resilient_detect_* (RTT, phi, generation)
    m.attach_straggler(monitor)              # resilient_straggler_*
    m.serve()                                # RESILIENT_METRICS_PORT + LOCAL_RANK (0: off)
    handle = ckpt.save(step, state); ...; m.observe_save(handle)

Series (all labelled rank): resilient_checkpoint_stall_seconds (histogram: time save() blocked
training), resilient_checkpoint_durable_seconds (histogram: save() to durable),
resilient_checkpoint_bytes_total, resilient_checkpoint_throughput_bytes_per_second,
resilient_checkpoint_saves_total{result}, resilient_checkpoint_last_durable_timestamp_seconds,
resilient_checkpoint_age_seconds (now - last durable, at scrape time; -1 before the first),
resilient_recoveries_total{path}, resilient_recovery_seconds (histogram), resilient_step;
with tiers (attach_tiers), labelled rank and tier: resilient_tier_newest_step,
resilient_tier_pending, resilient_tier_failing, resilient_tier_failures_total,
resilient_tier_bytes_total.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from resilient import settings
from resilient.telemetry import events

_STALL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LONG_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def metrics_port(local_rank: int | None = None) -> int:
    """RESILIENT_METRICS_PORT (0 or unset: no endpoint) + the local rank."""
    base = settings.get_or("RESILIENT_METRICS_PORT", 0)
    if base <= 0:
        return 0
    lr = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
    return base + lr


class RankMetrics:
    """The series of one rank in a registry of its own.

    Args:
        rank: label value.
        registry: a CollectorRegistry (default: a new one).
        clock: wall clock for the checkpoint age (injectable for tests).
    """

    def __init__(self, rank: int, registry: Any = None, clock: Callable[[], float] = time.time):
        import prometheus_client as prom

        self.prom = prom
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self.rank = str(rank)
        self._clock = clock
        self._last_durable: float | None = None
        kw: dict[str, Any] = {"registry": self.registry}
        self.stall = prom.Histogram("resilient_checkpoint_stall_seconds",
                                    "Time save() blocked training", ["rank"],
                                    buckets=_STALL_BUCKETS, **kw).labels(self.rank)
        self.durable = prom.Histogram("resilient_checkpoint_durable_seconds",
                                      "save() call to durable commit", ["rank"],
                                      buckets=_LONG_BUCKETS, **kw).labels(self.rank)
        self.bytes = prom.Counter("resilient_checkpoint_bytes", "Checkpoint bytes written",
                                  ["rank"], **kw).labels(self.rank)
        self.throughput = prom.Gauge("resilient_checkpoint_throughput_bytes_per_second",
                                     "Bytes / (save to durable) of the last save", ["rank"],
                                     **kw).labels(self.rank)
        self.saves = prom.Counter("resilient_checkpoint_saves", "Saves by result",
                                  ["rank", "result"], **kw)
        self.last_durable = prom.Gauge("resilient_checkpoint_last_durable_timestamp_seconds",
                                       "Wall time of the last durable checkpoint", ["rank"],
                                       **kw).labels(self.rank)
        age = prom.Gauge("resilient_checkpoint_age_seconds",
                         "Seconds since the last durable checkpoint (-1: none yet)", ["rank"],
                         **kw)
        age.labels(self.rank).set_function(self.checkpoint_age)
        self.recoveries = prom.Counter("resilient_recoveries", "Recoveries by path",
                                       ["rank", "path"], **kw)
        self.recovery_seconds = prom.Histogram("resilient_recovery_seconds",
                                               "Failure to training resumed", ["rank"],
                                               buckets=_LONG_BUCKETS, **kw).labels(self.rank)
        self.step = prom.Gauge("resilient_step", "Training steps done", ["rank"],
                               **kw).labels(self.rank)
        self._server: Any = None

    # ---- feeding ----
    def checkpoint_age(self) -> float:
        return -1.0 if self._last_durable is None else self._clock() - self._last_durable

    def record_save(self, ok: bool, stall_s: float = 0.0, durable_s: float = 0.0,
                    nbytes: int = 0, when: float | None = None) -> None:
        """One finished save: how long it stalled training, took to be durable, and its size."""
        self.saves.labels(self.rank, "ok" if ok else "failed").inc()
        if not ok:
            return
        self.stall.observe(stall_s)
        self.durable.observe(durable_s)
        self.bytes.inc(nbytes)
        if durable_s > 0:
            self.throughput.set(nbytes / durable_s)
        self._last_durable = when if when is not None else self._clock()
        self.last_durable.set(self._last_durable)

    def observe_save(self, handle: Any) -> None:
        """Records a finished SaveHandle (resilient.checkpoint) from its stats()."""
        try:
            handle.wait(0)
        except (OSError, TimeoutError, RuntimeError):
            self.record_save(False)
            return
        st = handle.stats()
        self.record_save(True, st.get("snapshot_s", 0.0), st.get("durable_s", 0.0),
                         int(st.get("bytes", 0)))

    def record_recovery(self, seconds: float, path: str = "in-job") -> None:
        self.recoveries.labels(self.rank, path).inc()
        self.recovery_seconds.observe(seconds)

    def on_event(self, record: dict[str, Any]) -> None:
        """Updates the series from one telemetry.events record (see events.EVENT_KINDS)."""
        kind = record.get("kind")
        if kind == "step":
            self.step.set(record.get("step", 0))
        elif kind == "save_end":
            self.record_save(bool(record.get("ok")), record.get("stall_s", 0.0),
                             record.get("seconds", 0.0), int(record.get("bytes", 0) or 0),
                             record.get("t"))
        elif kind == "recovery_end" and record.get("seconds") is not None:
            self.record_recovery(float(record["seconds"]), record.get("path", "in-job"))

    def follow_events(self) -> None:
        """Feeds on_event() with every event this process emits."""
        events.add_listener(self.on_event)

    # ---- other components' exporters ----
    def attach_detector(self, detector: Any) -> None:
        """resilient_detect_* (heartbeat RTT, phi suspicion, generation, counters)."""
        self.registry.register(detector.prometheus_collector())

    def attach_tiers(self, checkpointer: Any) -> None:
        """resilient_tier_* from a Checkpointer's tier_status() at each scrape (rank 0, which
        drains): newest step held, copy pending (0/1), failed attempts, bytes copied."""
        self.registry.register(_TierCollector(checkpointer, self.rank))

    def attach_straggler(self, monitor: Any) -> Any:
        """resilient_straggler_* scores, updated after every window."""
        return PrometheusExporter(monitor, registry=self.registry)

    # ---- exposition ----
    def serve(self, port: int | None = None, addr: str = "0.0.0.0") -> int:
        """Starts the HTTP endpoint; returns its port. Without `port`, uses metrics_port() and
        returns 0 (no endpoint) when RESILIENT_METRICS_PORT is unset; port=0: any free port."""
        if port is None:
            port = metrics_port()
            if port == 0:
                return 0
        server, _ = self.prom.start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def text(self) -> str:
        """The exposition text (what a scrape returns)."""
        return self.prom.generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


class _TierCollector:
    def __init__(self, checkpointer: Any, rank: str):
        self.checkpointer, self.rank = checkpointer, rank

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["rank", "tier"]
        newest = GaugeMetricFamily("resilient_tier_newest_step",
                                   "Newest step the tier holds (-1: none)", labels=labels)
        pending = GaugeMetricFamily("resilient_tier_pending",
                                    "1 while a newer committed step waits for or is being "
                                    "copied to the tier", labels=labels)
        failing = GaugeMetricFamily("resilient_tier_failing",
                                    "1 when the tier's last copy attempt failed", labels=labels)
        failures = CounterMetricFamily("resilient_tier_failures", "Failed copy attempts",
                                       labels=labels)
        copied = CounterMetricFamily("resilient_tier_bytes", "Bytes copied to the tier",
                                     labels=labels)
        for st in self.checkpointer.tier_status():
            lv = [self.rank, str(st["url"])]
            newest.add_metric(lv, max(st["steps"], default=-1))
            pending.add_metric(lv, int(st["pending"] is not None or st["copying"] is not None))
            failing.add_metric(lv, int(st["error"] is not None))
            failures.add_metric(lv, st["failures"])
            copied.add_metric(lv, st["bytes"])
        yield from (newest, pending, failing, failures, copied)


__all__ = ["RankMetrics", "metrics_port"]


_STRAGGLER_GAUGES = {
    "ratio": "Worst phase's slowdown versus the cross-rank median",
    "zscore": "Worst phase's robust (MAD) z-score",
    "cusum": "Persistence detector's cumulative sum",
    "slow": "1 if the rank was slow in the latest window",
    "persistent": "1 if the rank is a persistent straggler",
}


class PrometheusExporter:
    """Gauges resilient_straggler_<name>{rank} updated from a StragglerMonitor after every window.

    Args:
        monitor: chains onto its on_window callback.
        registry: a prometheus_client CollectorRegistry (default: the global one).

    Raises:
        ImportError: prometheus_client is not installed.
    """

    def __init__(self, monitor: Any, registry: Any = None):
        import prometheus_client as prom

        kw = {} if registry is None else {"registry": registry}
        self.gauges = {name: prom.Gauge(f"resilient_straggler_{name}", doc, ["rank"], **kw)
                       for name, doc in _STRAGGLER_GAUGES.items()}
        self.windows = prom.Gauge("resilient_straggler_windows", "Windows scored", **kw)
        previous = monitor.on_window
        self._monitor = monitor

        def on_window(result) -> None:
            self.update(result)
            if previous is not None:
                previous(result)

        monitor.on_window = on_window

    def update(self, result) -> None:
        """Sets the gauges from one WindowResult."""
        for sc in result.scores:
            rank = str(sc.rank)
            self.gauges["ratio"].labels(rank).set(sc.ratio)
            self.gauges["zscore"].labels(rank).set(sc.z)
            self.gauges["cusum"].labels(rank).set(sc.cusum)
            self.gauges["slow"].labels(rank).set(float(sc.slow))
            self.gauges["persistent"].labels(rank).set(float(sc.persistent))
        self.windows.set(result.window + 1)
