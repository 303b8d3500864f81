"""Job events as JSON lines, for `resilient chaos` and for operators' logs.

A training job calls ``emit(kind, **fields)`` at the points that matter for recovery reports
(see EVENT_KINDS). Events go to ``$RESILIENT_EVENTS_DIR/rank-<RANK>.jsonl`` (one file per rank,
appended with single ``write`` calls on an O_APPEND descriptor, so a line is never torn even if
the process is killed); without ``RESILIENT_EVENTS_DIR`` emit() does nothing and costs one dict
lookup. Every record carries ``t`` (wall-clock seconds, comparable across processes of one host),
``kind``, ``rank`` (``RESILIENT_EVENTS_RANK``, else ``RANK``, else -1) and ``pid``.

Example::

    from resilient.telemetry import events
    events.emit("step", step=12)
    events.emit("recovery_phase", phase="rebuild", seconds=0.8)
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

ENV_DIR = "RESILIENT_EVENTS_DIR"
ENV_RANK = "RESILIENT_EVENTS_RANK"

# kind -> the fields `resilient chaos` reads (others are kept as they are).
EVENT_KINDS: dict[str, str] = {
    "start": "world_size, attempt: a rank process started",
    "init_done": "world_size: process group (and detector) ready",
    "load": "step (None: fresh start), skipped [[step, why]], seconds: restored a checkpoint",
    "step": "step: a training step finished (step = number of steps done)",
    "save_begin": "step: Checkpointer.save called",
    "save_end": "step, ok, error, seconds (save call to durable), stall_s (time save() blocked),"
                " bytes: the save is durable (ok) or failed",
    "detected": "ranks, generation, source: this rank learned that ranks failed",
    "recovery_begin": "generation: in-job recovery started",
    "recovery_phase": "phase, seconds: one phase of in-job recovery finished",
    "recovery_end": "generation, world_size, step, seconds (failure to resumed), path: training"
                    " resumes at step",
    "done": "step, digest: training finished; digest = sha256 of the final model state",
    "fatal": "message: the job cannot continue (the message is shown to the operator)",
}

_lock = threading.Lock()
_listeners: list[Callable[[dict[str, Any]], None]] = []
_fd: int | None = None
_fd_path: str | None = None


def _rank() -> int:
    for key in (ENV_RANK, "RANK"):
        value = os.environ.get(key)
        if value is not None and value.lstrip("-").isdigit():
            return int(value)
    return -1


def enabled() -> bool:
    """True when RESILIENT_EVENTS_DIR is set (events are recorded)."""
    return bool(os.environ.get(ENV_DIR))


def add_listener(fn: Callable[[dict[str, Any]], None]) -> None:
    """Calls `fn(record)` for every event emitted in this process (e.g. RankMetrics), whether
    or not RESILIENT_EVENTS_DIR is set. Listener exceptions are swallowed."""
    _listeners.append(fn)


def remove_listener(fn: Callable[[dict[str, Any]], None]) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def emit(kind: str, **fields: Any) -> None:
    """Appends one event. Never raises for I/O errors (events must not break training)."""
    directory = os.environ.get(ENV_DIR)
    if not directory and not _listeners:
        return
    record = {"t": time.time(), "kind": kind, "rank": _rank(), "pid": os.getpid(), **fields}
    for fn in list(_listeners):
        try:
            fn(record)
        except Exception:  # noqa: BLE001 - observers must not break training
            pass
    if not directory:
        return
    line = (json.dumps(record, default=str) + "\n").encode()
    path = os.path.join(directory, f"rank-{record['rank']}.jsonl")
    global _fd, _fd_path
    with _lock:
        try:
            if _fd is None or _fd_path != path:
                if _fd is not None:
                    os.close(_fd)
                os.makedirs(directory, exist_ok=True)
                _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                _fd_path = path
            os.write(_fd, line)
        except OSError:
            pass


def read_events(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """Every event under `directory` (all ranks), sorted by time. Torn last lines are skipped."""
    out: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        out.extend(_parse(path.read_text(errors="replace")))
    out.sort(key=lambda e: e.get("t", 0.0))
    return out


def _parse(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            yield record


class Tail:
    """Incremental reader of an events directory: ``poll()`` returns the events new since the
    last call (complete lines only), across every rank file."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        if not self.directory.is_dir():
            return new
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            if end == 0:
                continue
            self._offsets[path] = offset + end
            new.extend(_parse(data[:end].decode(errors="replace")))
        new.sort(key=lambda e: e.get("t", 0.0))
        return new


__all__ = ["ENV_DIR", "EVENT_KINDS", "Tail", "add_listener", "emit", "enabled", "read_events",
           "remove_listener"]
