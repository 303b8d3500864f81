"""The recovery timeline: timestamped events of every phase, and their split into durations.

Each event carries ``time_mono`` (``time.monotonic()``, CLOCK_MONOTONIC: comparable between
processes of one host, so a launcher can subtract the time it injected a fault) and
``time_wall``. Kinds, in the order a recovery produces them:

``failure_observed`` (cause: collective_error | verdict | timeout), ``agreed`` (generation,
removed, members), ``rebuilt`` (method, rank, world_size), ``restored`` (source: memory | peer |
storage, step), ``policy`` (message, accum_steps, lr_factor), ``first_collective`` (the first
gradient all-reduce that completed on the new group), and ``stopped`` / ``evicted`` when the
rank gives up, ``device_lost`` (step, error) when its device is unusable and the process
leaves. ``fault`` marks an injected fault (the chaos runner and the example write it).

Each event is also forwarded to ``resilient.telemetry.events`` (the chaos runner's JSON-lines
log, a no-op unless ``RESILIENT_EVENTS_DIR`` is set or a listener is registered) in that
module's vocabulary: ``detected``, ``recovery_begin``, ``recovery_phase`` (phase, seconds),
``recovery_end`` (seconds from failure to resumed) and ``fatal``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from resilient.recovery import report
from resilient.telemetry import events as job_events

PHASES = ("detection", "agreement", "rebuild", "restore", "first_collective")
_PHASE_END = {"detection": "failure_observed", "agreement": "agreed", "rebuild": "rebuilt",
              "restore": "restored", "first_collective": "first_collective"}


class Timeline:
    """A thread-safe list of events (dicts) for one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Records an event now; returns it."""
        ev = {"kind": kind, "rank": self.rank, "time_mono": time.monotonic(),
              "time_wall": time.time(), **fields}
        with self._lock:
            # the previous event of the training thread's sequence (not a background abort's)
            prev = next((e for e in reversed(self._events) if e["kind"] not in _BACKGROUND),
                        None)
            begin = next((e for e in reversed(self._events)
                          if e["kind"] == "failure_observed"), None)
            self._events.append(ev)
        _forward(ev, prev, begin)
        report.phase(ev, self.rank)
        return ev

    @property
    def events(self) -> list[dict[str, Any]]:
        """A copy of the events so far."""
        with self._lock:
            return list(self._events)

    def to_json(self) -> str:
        """The events as a JSON array."""
        return json.dumps(self.events)

    def recoveries(self) -> list[dict[str, Any]]:
        """One dict of phase durations per recovery (see :func:`phases`)."""
        out, current = [], []
        for ev in self.events:
            if ev["kind"] == "failure_observed" and current:
                out.append(phases(current))
                current = []
            if ev["kind"] != "fault":
                current.append(ev)
        if current:
            out.append(phases(current))
        return [r for r in out if r]


# Events that other threads add at any moment of a recovery (the old group's revoke and abort).
_BACKGROUND = frozenset({"revoked", "abort_finished"})
_PHASE_OF = {"agreed": "agreement", "rebuilt": "rebuild", "restored": "restore",
             "first_collective": "first_collective"}


def _forward(ev: dict[str, Any], prev: dict[str, Any] | None,
             begin: dict[str, Any] | None) -> None:
    """Re-emits ``ev`` through resilient.telemetry.events (see the module docstring)."""
    kind = ev["kind"]
    since = ev["time_mono"] - prev["time_mono"] if prev else 0.0
    if kind == "verdict":
        job_events.emit("detected", ranks=ev.get("removed"), generation=ev.get("generation"),
                        source="detector")
    elif kind == "failure_observed":
        job_events.emit("recovery_begin", generation=None, cause=ev.get("cause"),
                        step=ev.get("step"))
    elif kind in _PHASE_OF:
        job_events.emit("recovery_phase", phase=_PHASE_OF[kind], seconds=since)
        if kind == "first_collective" and begin is not None:
            job_events.emit("recovery_end", generation=ev.get("generation"),
                            world_size=ev.get("world_size"), step=ev.get("step"),
                            path="in_process",
                            seconds=ev["time_mono"] - begin["time_mono"])
    elif kind == "stopped":
        job_events.emit("fatal", message=ev.get("reason"))
    elif kind == "device_lost":  # the process ends at once: this line is what stays of it
        job_events.emit("fatal", message=f"device lost at step {ev.get('step')}: "
                                         f"{ev.get('error')}; the process leaves the job")


def phases(events: list[dict[str, Any]], t_fault: float | None = None) -> dict[str, Any]:
    """Durations (seconds) of one recovery's phases from its events.

    ``detection`` runs from ``t_fault`` (the fault's ``time_mono``, when known) to
    ``failure_observed``; each later phase from the previous phase's end to its own event.
    ``total_s`` is fault (or observation) -> first collective. Missing events give no entry.
    """
    first = {}
    for ev in events:
        first.setdefault(ev["kind"], ev)
    if "failure_observed" not in first:
        return {}
    out: dict[str, Any] = {"cause": first["failure_observed"].get("cause")}
    prev = t_fault
    for name in PHASES:
        ev = first.get(_PHASE_END[name])
        if ev is None:
            break
        if prev is not None:
            out[f"{name}_s"] = ev["time_mono"] - prev
        prev = ev["time_mono"]
    start = t_fault if t_fault is not None else first["failure_observed"]["time_mono"]
    if "first_collective" in first:
        out["total_s"] = first["first_collective"]["time_mono"] - start
    if "restored" in first:
        out["source"] = first["restored"].get("source")
        out["to_restored_s"] = first["restored"]["time_mono"] - start
    if "rebuilt" in first:
        out["method"] = first["rebuilt"].get("method")
    return out


__all__ = ["PHASES", "Timeline", "phases"]
