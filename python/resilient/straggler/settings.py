"""Settings of the straggler monitor.

The detector's settings live in the native `StragglerOptions` (typed defaults, RESILIENT_STRAGGLER_*
environment overrides, attribute setters); the monitor adds two Python-side settings. All are
listed in docs/SETTINGS.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from resilient._C import straggler as _core

StragglerOptions = _core.StragglerOptions

_FEATURES = {"auto": "auto", "on": "on", "1": "on", "true": "on", "off": "off", "0": "off",
             "false": "off"}


def default_options() -> StragglerOptions:
    """Detector options: defaults overridden by RESILIENT_STRAGGLER_* (ValueError if malformed)."""
    return StragglerOptions.from_env()


def _env_float(name: str, fallback: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return fallback
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not a number") from None


def _env_feature(name: str, fallback: str) -> str:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return fallback
    if raw not in _FEATURES:
        raise ValueError(f"{name}={raw!r}: expected auto, on or off")
    return _FEATURES[raw]


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
        default_factory=lambda: _env_float("RESILIENT_STRAGGLER_EXCHANGE_TIMEOUT_S", 60.0))
    cuda_events: str = field(
        default_factory=lambda: _env_feature("RESILIENT_STRAGGLER_CUDA_EVENTS", "auto"))

    def validate(self) -> None:
        """Raises ValueError for an out-of-range setting."""
        if not self.exchange_timeout_s > 0:
            raise ValueError("exchange_timeout_s must be > 0")
        if self.cuda_events not in ("auto", "on", "off"):
            raise ValueError("cuda_events must be auto, on or off")
