"""What a recovery tells the user, in the log lines torchrun's users know.

One WARNING line per recovery, on rank 0 of the rebuilt group, once its first collective
completed: which ranks were lost and why, at which step, the world before and after, how the
step goes on (redone from memory, a checkpoint loaded, a peer's state), the batch policy's
decision and the time from the failure to that first collective::

    W1128 23:57:05.123456 4567 resilient/recovery/core.py:690] [rank0]: resilient: lost rank 1
    (its process is gone) at step 7: world 4 -> 3, step 7 redone (state kept in memory), batch
    policy keep_batch: global batch 32 kept with 2 accumulation step(s); recovered in 0.44 s
    (failed step seen -> first collective)

Every rank also logs each phase of its own recovery at INFO (``RESILIENT_LOG_LEVEL=info``), and a
rank the others removed says so at ERROR before it leaves (resilient.recovery.policy.
EXIT_EVICTED). The format is torch's own (``torch._logging``: level letter, date and time to the
microsecond, pid, file:line), with the ``[rank<r>]:`` prefix torch puts on a rank's messages; a
worker's stderr is the launcher's output, so under ``resilient run`` the line is there too. An
application that configured logging itself (a handler on the root logger) gets the records
through its own handlers and formats instead.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("resilient.recovery")

#: how a detector's reason for a removal reads
REASONS = {"crash": "its process is gone",
           "unresponsive": "it stopped answering: frozen, stopped or cut off",
           "hang": "its training stalled past the hang limit"}


class TorchFormatter(logging.Formatter):
    """``W1128 23:57:05.123456 4567 resilient/recovery/core.py:690] message``: torch's log
    line (torch._logging's glog-style format), with the path from the package's directory."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
        micros = int(record.created % 1 * 1e6)
        path = record.pathname
        cut = path.rfind(f"{os.sep}resilient{os.sep}")
        path = path[cut + 1:] if cut >= 0 else os.path.basename(path)
        line = (f"{record.levelname[:1]}{when}.{micros:06d} {record.process} {path}:"
                f"{record.lineno}] {record.getMessage()}")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _StderrUnlessConfigured(logging.StreamHandler):
    """stderr in torch's format, while the application has no logging of its own (its root
    handlers then receive the records by propagation, formatted its way)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "error": logging.ERROR}


def install() -> None:
    """Gives the ``resilient.recovery`` logger its stderr handler (once) and, unless the
    application set one, the level of ``RESILIENT_LOG_LEVEL`` (default warn)."""
    if not any(isinstance(h, _StderrUnlessConfigured) for h in log.handlers):
        handler = _StderrUnlessConfigured(sys.stderr)
        handler.setFormatter(TorchFormatter())
        log.addHandler(handler)
    if log.level == logging.NOTSET:
        from resilient import settings

        try:
            log.setLevel(_LEVELS.get(str(settings.get("RESILIENT_LOG_LEVEL")), logging.WARNING))
        except ValueError:
            log.setLevel(logging.WARNING)


def _ranks(ranks: list[int]) -> str:
    from resilient.recovery.join import JOIN_BASE

    names = [f"joiner {r - JOIN_BASE}" if r >= JOIN_BASE else str(r) for r in ranks]
    return f"rank {names[0]}" if len(names) == 1 else f"ranks {', '.join(names)}"


def _why(ranks: list[int], reasons: dict[Any, str]) -> str:
    whys = {REASONS.get(reasons.get(r) or reasons.get(str(r), ""), "") for r in ranks}
    whys.discard("")
    return f" ({'; '.join(sorted(whys))})" if whys else ""


def _lost(ranks: list[int], reasons: dict[Any, str]) -> str:
    """``rank 1 (why)``, ``ranks 1, 2 (why)``, or ``rank 1 (why) and rank 2 (why)``."""
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(_why([r], reasons), []).append(r)
    return " and ".join(f"{_ranks(rs)}{why}" for why, rs in groups.items())


def _restored(ev: dict[str, Any] | None) -> str:
    if ev is None:
        return ""
    step, source = ev.get("step"), ev.get("source")
    return {"memory": f"step {step} redone (state kept in memory)",
            "memory+peer": f"step {step} redone (the joiners took the survivors' state)",
            "peer": f"the survivors' steps differed: going on from step {step}, the most "
                    "advanced survivor's state",
            "storage": f"the survivors' steps differed: going back to step {step}, the newest "
                       "checkpoint"}.get(str(source), f"state {source} at step {step}")


def summary(events: list[dict[str, Any]], policy: str, loader_batches: bool = False) -> str | None:
    """The one line of the recovery (or admission) whose events are `events` (everything after
    the previous ``first_collective``, ending with this one), or None when they hold neither a
    failure nor an admission (pure). `policy`: the batch policy's name; `loader_batches`: a
    step is one batch of each rank's own DataLoader (Recovery without global_batch)."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for ev in events:
        kinds.setdefault(ev["kind"], []).append(ev)
    end = kinds.get("first_collective", [{}])[-1]
    world = end.get("world_size")
    restored = kinds.get("restored", [None])[-1]
    decision = kinds.get("policy", [{}])[-1].get("message", "")
    failed = kinds.get("failure_observed", [])
    parts: list[str] = []
    if failed:
        lost: list[int] = []
        for ev in kinds.get("agreed", []):
            lost += [r for r in ev.get("removed", []) if r not in lost]
        reasons: dict[Any, str] = {}
        for ev in kinds.get("verdict", []):
            reasons.update(ev.get("reasons") or {})
        before = len(kinds["agreed"][0].get("members", [])) + len(
            kinds["agreed"][0].get("removed", [])) if kinds.get("agreed") else None
        what = (f"lost {_lost(lost, reasons)}" if lost
                else f"a collective failed ({failed[0].get('cause')})")
        parts.append(f"{what} at step {failed[0].get('step')}: world "
                     f"{before if before is not None else '?'} -> {world}")
        joiners = [j for ev in kinds.get("join_admitted", []) for j in ev.get("joiners", [])]
        if joiners:
            parts.append(f"{_ranks(joiners)} took the place of the lost")
    elif kinds.get("join_admitted"):
        joiners = [j for ev in kinds["join_admitted"] for j in ev.get("joiners", [])]
        parts.append(f"{_ranks(joiners)} joined at step {kinds['join_admitted'][0].get('step')}"
                     f": world {(world or 0) - len(joiners)} -> {world}")
    else:
        return None
    if restored is not None and failed:
        parts.append(_restored(restored))
    if loader_batches and decision:
        factor = kinds["policy"][-1].get("lr_factor", 1.0)
        parts.append(f"batch policy {policy}: one DataLoader batch per rank and step (the "
                     f"global batch follows the world)" + (f", learning rate x{factor:.4g}"
                                                           if factor != 1.0 else ""))
    elif decision:
        parts.append(f"batch policy {policy}: {decision.split(': ', 1)[-1]}")
    took = (f"; recovered in {end['time_mono'] - failed[0]['time_mono']:.2f} s (failed step "
            "seen -> first collective)" if failed and "time_mono" in end else "")
    return "resilient: " + ", ".join(p for p in parts if p) + took


# Each phase of a recovery at INFO, on every rank (the background threads' events at DEBUG).
_PHASES = {
    "verdict": lambda e: f"the detector removed {_ranks(e.get('removed', []))}"
                         f"{_why(e.get('removed', []), e.get('reasons') or {})} "
                         f"(generation {e.get('generation')})",
    "failure_observed": lambda e: f"step {e.get('step')} failed ({e.get('cause')}"
                                  f"{': ' + e['error'] if e.get('error') else ''})",
    "agreed": lambda e: f"agreed on generation {e.get('generation')}: members "
                        f"{e.get('members')}, removed {e.get('removed')}",
    "rebuild_failed": lambda e: f"the group of generation {e.get('generation')} was not built "
                                f"({e.get('error')}): waiting for the next",
    "rebuilt": lambda e: f"group rebuilt ({e.get('method')}): rank {e.get('rank')} of "
                         f"{e.get('world_size')}, {e.get('seconds', 0):.3f} s",
    "checkpointer_regrouped": lambda e: "checkpoint manager on the new group"
                                        + (f" (saves of steps {e['abandoned']} not committed)"
                                           if e.get("abandoned") else ""),
    "restored": lambda e: _restored(e),
    "policy": lambda e: (f"world -> {e.get('world_size', '?')}: one DataLoader batch per rank "
                         "and step" if e.get("loader_batches") else str(e.get("message", ""))),
    "first_collective": lambda e: f"first collective on the new group at step {e.get('step')}",
    "join_admitted": lambda e: f"admitting {_ranks(e.get('joiners', []))} at step "
                               f"{e.get('step')}",
}


def phase(ev: dict[str, Any], rank: int) -> None:
    """Logs one timeline event of rank `rank` (the process's first rank; an event's own
    ``rank`` may be its rank in a new group): INFO for a recovery's phases, DEBUG for the rest,
    as ``[rank<r>]: resilient recovery: <what>``."""
    describe = _PHASES.get(ev["kind"])
    if describe is not None and log.isEnabledFor(logging.INFO):
        log.info("[rank%s]: resilient recovery: %s", rank, describe(ev), stacklevel=3)
    elif describe is None and log.isEnabledFor(logging.DEBUG):
        log.debug("[rank%s]: resilient recovery: %s", rank, ev, stacklevel=3)


__all__ = ["REASONS", "TorchFormatter", "install", "log", "phase", "summary"]
