"""Settings of the straggler monitor.

The detector's settings live in the native `StragglerOptions` (typed defaults, RESILIENT_STRAGGLER_*
environment overrides, attribute setters); the monitor adds two Python-side settings. All are
listed in docs/SETTINGS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resilient import settings
from resilient._C import straggler as _core

StragglerOptions = _core.StragglerOptions


def default_options() -> StragglerOptions:
    """Detector options: defaults overridden by RESILIENT_STRAGGLER_* (ValueError if malformed)."""
    return StragglerOptions.from_env()


@dataclass
class MonitorSettings:
    """Python-side settings of StragglerMonitor.

    Attributes:
        exchange_timeout_s: deadline for one summary exchange to complete once the monitor has to
            wait for it (RESILIENT_STRAGGLER_EXCHANGE_TIMEOUT_S, default 60).
        cuda_events: "auto" times the compute phase with CUDA events when CUDA is available, "on"
            requires CUDA, "off" uses host timers (RESILIENT_STRAGGLER_CUDA_EVENTS).
    """

    exchange_timeout_s: float = field(
        default_factory=lambda: settings.get("RESILIENT_STRAGGLER_EXCHANGE_TIMEOUT_S"))
    cuda_events: str = field(
        default_factory=lambda: settings.get("RESILIENT_STRAGGLER_CUDA_EVENTS"))

    def validate(self) -> None:
        """Raises ValueError for an out-of-range setting."""
        if not self.exchange_timeout_s > 0:
            raise ValueError("exchange_timeout_s must be > 0")
        if self.cuda_events not in ("auto", "on", "off"):
            raise ValueError("cuda_events must be auto, on or off")
