"""The survivors of one generation meet before any of them builds its group.

The detector may decide two generations in quick succession (a host cut off: one of its ranks is
removed, then the other). A survivor that saw the first verdict starts rebuilding that
generation; one that saw only the second starts the second. Group creation blocks in torch until
every member arrived, so the two would each wait out the group timeout and stop (seen in CI on
emulated hosts). Before creating the group, every survivor checks in at its generation's gate
and the gate gets one outcome, written once with compare-and-set:

- ``go``: every expected member checked in; all build this generation's group;
- ``abandon``: a newer generation that removes a member was decided first (or the wait timed
  out); every survivor of this generation leaves it and agrees on the newer one.

Whoever reads the outcome follows it, so no survivor builds a group the others left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from resilient.errors import GateAbandoned

__all__ = ["GateAbandoned", "meet"]

GO, ABANDON = b"go", b"abandon"


def meet(store: Any, namespace: str, me: int, members: Sequence[int],
         newer: Callable[[], bool], timeout_s: float, *,
         clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], Any] = time.sleep, poll_s: float = 0.01) -> None:
    """Checks ``me`` in at the gate under ``namespace`` (a torch Store key prefix unique to the
    generation) and waits for its outcome. Returns when it is ``go``.

    ``newer()`` says whether a newer generation that removes a member was decided; it is asked
    only while not every member arrived, so a gate every member reached always opens.

    Raises:
        GateAbandoned: the outcome is ``abandon`` (the caller moves on to the next generation).
    """
    prefix = f"{namespace}/resilient-gate"
    outcome = f"{prefix}/outcome"
    arrived = [f"{prefix}/in/{m}" for m in members]
    store.set(f"{prefix}/in/{me}", b"1")
    deadline = clock() + timeout_s
    why = ""
    while True:
        if store.check([outcome]):
            value = bytes(store.get(outcome))
        elif store.check(arrived):
            value = bytes(store.compare_set(outcome, "", GO))
        elif newer():
            why = "a newer generation was decided first"
            value = bytes(store.compare_set(outcome, "", ABANDON))
        elif clock() > deadline:
            missing = [m for m, k in zip(members, arrived) if not store.check([k])]
            why = f"members {missing} did not arrive within {timeout_s} s"
            value = bytes(store.compare_set(outcome, "", ABANDON))
        else:
            sleep(poll_s)
            continue
        if value == GO:
            return
        if value == ABANDON:
            raise GateAbandoned(f"{namespace} abandoned{': ' + why if why else ''}")
        raise GateAbandoned(f"{namespace}: unexpected gate outcome {value!r}")
