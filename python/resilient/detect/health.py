"""GPU health checks before a rank joins or rejoins a job, through NVML loaded at run time.

NVML (libnvidia-ml.so.1) is opened with ctypes when a check runs, so the same code runs where
there is no GPU driver: the report then says NVML is unavailable and why (with
``RESILIENT_NVML=on`` that is an error instead). Per device it reads volatile uncorrectable ECC
errors, pages retired for double-bit errors and pending retirement, row remapping (pending,
failed) and, during a short watch, critical XID events (NVML only reports XIDs that happen after
registering, so earlier ones are in the kernel log, not here). ``judge()`` turns readings into
a verdict and is a pure function of (readings, config).

Settings: RESILIENT_NVML (auto|on|off), RESILIENT_NVML_LIBRARY (path or soname),
RESILIENT_HEALTH_XID_WATCH_MS (default 0: no watch); ``configure()`` sets them in process.

    python -m resilient.detect.health            # prints the report, exit 1 when unhealthy
"""

from __future__ import annotations

import ctypes
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from resilient import settings

# XIDs that mean the GPU must not (re)join: double-bit ECC, row-remap events, NVLink errors,
# fell off the bus, uncontained/contained ECC, GSP errors.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})

_NVML_SUCCESS = 0
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_TIMEOUT = 10
_MEMORY_ERROR_UNCORRECTED = 1
_VOLATILE_ECC = 0
_RETIRED_DOUBLE_BIT = 1
_EVENT_XID = 0x8


@dataclass
class HealthConfig:
    """Health check settings (see module docstring for the environment variables)."""

    nvml: str = "auto"
    library: str = "libnvidia-ml.so.1"
    xid_watch_ms: int = 0

    @classmethod
    def from_env(cls) -> HealthConfig:
        c = cls()
        c.nvml = settings.get("RESILIENT_NVML")
        c.library = settings.get("RESILIENT_NVML_LIBRARY")
        c.xid_watch_ms = settings.get("RESILIENT_HEALTH_XID_WATCH_MS")
        if c.nvml not in ("auto", "on", "off"):
            raise ValueError(f"RESILIENT_NVML must be auto, on or off, not {c.nvml!r}")
        return c


_overrides: dict[str, Any] = {}


def configure(**settings: Any) -> None:
    """Python setter for the settings: configure(nvml="off", xid_watch_ms=200)."""
    for k in settings:
        if k not in HealthConfig.__dataclass_fields__:
            raise TypeError(f"unknown health setting {k!r}")
    _overrides.update(settings)


def current_config() -> HealthConfig:
    c = HealthConfig.from_env()
    for k, v in _overrides.items():
        setattr(c, k, v)
    return c


@dataclass
class DeviceReading:
    """What NVML said about one GPU; None where the query is not supported."""

    index: int
    uncorrectable_ecc: int | None = None
    retired_double_bit: int | None = None
    retired_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    xids: list[int] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)


@dataclass
class HealthReport:
    available: bool
    reason: str
    healthy: bool
    devices: list[DeviceReading] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(readings: list[DeviceReading]) -> list[str]:
    """The problems that keep a rank out, one line each (empty: healthy)."""
    out = []
    for d in readings:
        if d.uncorrectable_ecc:
            out.append(f"GPU {d.index}: {d.uncorrectable_ecc} uncorrectable ECC errors")
        if d.retired_pending:
            out.append(f"GPU {d.index}: page retirement pending (needs a reset)")
        if d.remap_pending:
            out.append(f"GPU {d.index}: row remapping pending (needs a reset)")
        if d.remap_failed:
            out.append(f"GPU {d.index}: row remapping failed")
        bad = sorted(set(d.xids) & CRITICAL_XIDS)
        if bad:
            out.append(f"GPU {d.index}: critical XID events {bad}")
    return out


class _XidEvent(ctypes.Structure):
    _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong),
                ("eventData", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


def _read_device(lib: Any, index: int, handle: ctypes.c_void_p) -> DeviceReading:
    d = DeviceReading(index=index)
    n = ctypes.c_ulonglong()
    rc = lib.nvmlDeviceGetTotalEccErrors(handle, _MEMORY_ERROR_UNCORRECTED, _VOLATILE_ECC,
                                         ctypes.byref(n))
    if rc == _NVML_SUCCESS:
        d.uncorrectable_ecc = n.value
    else:
        d.unsupported.append(f"ecc (nvml {rc})")
    count = ctypes.c_uint(0)
    rc = lib.nvmlDeviceGetRetiredPages(handle, _RETIRED_DOUBLE_BIT, ctypes.byref(count), None)
    if rc == _NVML_SUCCESS:
        d.retired_double_bit = count.value
    else:
        d.unsupported.append(f"retired pages (nvml {rc})")
    pending = ctypes.c_int(0)
    rc = lib.nvmlDeviceGetRetiredPagesPendingStatus(handle, ctypes.byref(pending))
    if rc == _NVML_SUCCESS:
        d.retired_pending = bool(pending.value)
    else:
        d.unsupported.append(f"retirement pending (nvml {rc})")
    corr, unc, rpend, rfail = (ctypes.c_uint(0) for _ in range(4))
    fn = getattr(lib, "nvmlDeviceGetRemappedRows", None)
    rc = fn(handle, ctypes.byref(corr), ctypes.byref(unc), ctypes.byref(rpend),
            ctypes.byref(rfail)) if fn else _NVML_ERROR_NOT_SUPPORTED
    if rc == _NVML_SUCCESS:
        d.remap_pending, d.remap_failed = bool(rpend.value), bool(rfail.value)
    else:
        d.unsupported.append(f"row remapping (nvml {rc})")
    return d


def _watch_xids(lib: Any, handles: list[ctypes.c_void_p], readings: list[DeviceReading],
                watch_ms: int) -> None:
    evset = ctypes.c_void_p()
    if lib.nvmlEventSetCreate(ctypes.byref(evset)) != _NVML_SUCCESS:
        return
    try:
        for h, d in zip(handles, readings):
            if lib.nvmlDeviceRegisterEvents(h, ctypes.c_ulonglong(_EVENT_XID), evset) != 0:
                d.unsupported.append("xid events")
        data = _XidEvent()
        wait = getattr(lib, "nvmlEventSetWait_v2", None) or lib.nvmlEventSetWait
        while wait(evset, ctypes.byref(data), ctypes.c_uint(watch_ms)) == _NVML_SUCCESS:
            for h, d in zip(handles, readings):
                if data.device == h.value:
                    d.xids.append(int(data.eventData))
            watch_ms = 0  # drain what is queued, then stop
    finally:
        lib.nvmlEventSetFree(evset)


def check(config: HealthConfig | None = None) -> HealthReport:
    """Runs the checks on every visible GPU. Raises RuntimeError only with nvml="on" when NVML
    cannot be used; otherwise an unavailable NVML gives available=False, healthy=True."""
    cfg = config or current_config()
    if cfg.nvml == "off":
        return HealthReport(False, "NVML disabled (RESILIENT_NVML=off)", True)
    try:
        lib = ctypes.CDLL(cfg.library)
    except OSError as e:
        return _absent(cfg, f"NVML not found ({cfg.library}: {e})")
    init = getattr(lib, "nvmlInit_v2", None) or getattr(lib, "nvmlInit", None)
    if init is None or init() != _NVML_SUCCESS:
        return _absent(cfg, "nvmlInit failed (no driver or no GPU)")
    try:
        count = ctypes.c_uint(0)
        get_count = getattr(lib, "nvmlDeviceGetCount_v2", None) or lib.nvmlDeviceGetCount
        if get_count(ctypes.byref(count)) != _NVML_SUCCESS:
            return _absent(cfg, "nvmlDeviceGetCount failed")
        handles, readings = [], []
        by_index = getattr(lib, "nvmlDeviceGetHandleByIndex_v2", None) or \
            lib.nvmlDeviceGetHandleByIndex
        for i in range(count.value):
            h = ctypes.c_void_p()
            if by_index(ctypes.c_uint(i), ctypes.byref(h)) != _NVML_SUCCESS:
                readings.append(DeviceReading(index=i, unsupported=["handle"]))
                continue
            handles.append(h)
            readings.append(_read_device(lib, i, h))
        if cfg.xid_watch_ms > 0 and handles:
            _watch_xids(lib, handles, [r for r in readings if "handle" not in r.unsupported],
                        cfg.xid_watch_ms)
    finally:
        lib.nvmlShutdown()
    problems = judge(readings)
    return HealthReport(True, f"NVML: {len(readings)} device(s)", not problems, readings,
                        problems)


def _absent(cfg: HealthConfig, reason: str) -> HealthReport:
    if cfg.nvml == "on":
        raise RuntimeError(f"RESILIENT_NVML=on but {reason}")
    return HealthReport(False, reason, True)


def main() -> int:
    report = check()
    json.dump(report.as_dict(), sys.stdout, indent=2)
    print()
    return 0 if report.healthy else 1


if __name__ == "__main__":
    sys.exit(main())
