"""Straggler detection: name the slow rank in time, with evidence, at negligible overhead.

See docs/straggler.md. The statistics run in the native core (resilient._C.straggler); this
package measures steps in the training loop and exchanges one small summary every K steps.
"""

from __future__ import annotations

from resilient._C.straggler import (
    Phase,
    StragglerDetector,
    StragglerOptions,
    StragglerReport,
    WindowResult,
    mad,
    median,
    summarize,
)
from resilient.straggler.exchange import LocalExchange, SummaryExchange, TorchExchange
from resilient.straggler.monitor import StragglerMonitor, TimelinePoint
from resilient.straggler.settings import MonitorSettings, default_options
from resilient.telemetry.metrics import PrometheusExporter

__all__ = [
    "LocalExchange",
    "MonitorSettings",
    "Phase",
    "PrometheusExporter",
    "StragglerDetector",
    "StragglerMonitor",
    "StragglerOptions",
    "StragglerReport",
    "SummaryExchange",
    "TimelinePoint",
    "TorchExchange",
    "WindowResult",
    "default_options",
    "mad",
    "median",
    "summarize",
]
