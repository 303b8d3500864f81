"""Prometheus export of a StragglerMonitor's latest verdict (prometheus_client is optional)."""

from __future__ import annotations

from typing import Any

from resilient.straggler.monitor import StragglerMonitor

_GAUGES = {
    "ratio": "Worst phase's slowdown versus the cross-rank median",
    "zscore": "Worst phase's robust (MAD) z-score",
    "cusum": "Persistence detector's cumulative sum",
    "slow": "1 if the rank was slow in the latest window",
    "persistent": "1 if the rank is a persistent straggler",
}


class PrometheusExporter:
    """Gauges resilient_straggler_<name>{rank} updated from the monitor after every window.

    Args:
        monitor: chains onto its on_window callback.
        registry: a prometheus_client CollectorRegistry (default: the global one).

    Raises:
        ImportError: prometheus_client is not installed.
    """

    def __init__(self, monitor: StragglerMonitor, registry: Any = None):
        import prometheus_client as prom

        kw = {} if registry is None else {"registry": registry}
        self.gauges = {name: prom.Gauge(f"resilient_straggler_{name}", doc, ["rank"], **kw)
                       for name, doc in _GAUGES.items()}
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
