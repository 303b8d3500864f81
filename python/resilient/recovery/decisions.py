"""The recovery loop's decisions as pure functions of (now, state, config).

Recovery polls: an in-flight collective (done? evicted? a verdict against a member? past its
deadline?) and, after a failure, the detector's agreed membership. Each poll asks one function
here what to do, passing the time, so the timeout logic is tested with an injected clock and no
sleeping (tests/python/test_recovery_decisions.py). Failures are classified by exception type.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from resilient.errors import PeerFailure, RecoveryStopped  # noqa: F401 -- re-exported


def poll_collective(now: float, deadline: float, *, evicted: bool,
                    member_failed: bool) -> str | None:
    """While a collective is in flight and not done: the cause to abandon it with
    ("evicted", "verdict", "timeout"), or None to keep polling."""
    if evicted:
        return "evicted"
    if member_failed:
        return "verdict"
    if now > deadline:
        return "timeout"
    return None


def member_failed(generation: int, live: list[int] | set[int], *, min_generation: int,
                  watched: set[int]) -> bool:
    """True when the detector's decided generation (at least `min_generation`: older ones
    were already handled) no longer holds every watched member."""
    return generation >= min_generation and not watched <= set(live)


@dataclass(frozen=True)
class Agreement:
    """What to do while waiting for the detector's verdict after a failure."""

    action: str  # "agreed", "wait", "evicted" or "timeout"
    generation: int = -1
    live: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


def agree(now: float, deadline: float, generation: int, live: list[int], *,
          min_generation: int, watched: set[int], evicted: bool) -> Agreement:
    """After a collective failed: "agreed" once the detector decided a generation that removes
    a watched member (with the removed ranks), "evicted" if this rank was removed, "timeout"
    past the deadline (a failure the detector does not confirm), else "wait"."""
    if member_failed(generation, live, min_generation=min_generation, watched=watched):
        removed = sorted(m for m in watched if m not in set(live))
        return Agreement("agreed", generation, list(live), removed)
    if evicted:
        return Agreement("evicted")
    if now > deadline:
        return Agreement("timeout")
    return Agreement("wait")


def classify(exc: BaseException, pending: str | None = None) -> str | None:
    """The failure cause of `exc` raised from a training step, or None when it is not a peer
    failure (then it is the program's own error and is re-raised). `pending`: a cause the
    poll loop recorded before the collective's own error surfaced.

    By type and origin, never by message: PeerFailure carries its cause (the collectives
    Recovery issues itself are polled and wrapped); torch's DistError family (DistBackendError,
    DistNetworkError, DistStoreError: NCCL and the store) is a collective error; so is a
    RuntimeError raised from inside torch.distributed or DDP's own collectives (gloo reports a
    dead peer as a plain RuntimeError, e.g. when DDP broadcasts buffers). Anything else is the
    program's own error, whatever its message says."""
    if pending is not None:
        return pending
    if isinstance(exc, PeerFailure):
        return exc.cause
    if isinstance(exc, _dist_errors()):
        return "collective_error"
    if isinstance(exc, RuntimeError) and _raised_in_torch_distributed(exc):
        return "collective_error"
    return None


_COLLECTIVE_CODE = (f"{os.sep}torch{os.sep}distributed{os.sep}",
                    f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}distributed.py")


# A functional collective's wait (DTensor redistribution, full_tensor, FSDP2's state dicts)
# raises from the dispatcher below it (torch/_ops.py), not from torch.distributed's own code.
_COLLECTIVE_WAIT = f"{os.sep}torch{os.sep}distributed{os.sep}_functional_collectives.py"


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    """True when the innermost Python frame of the traceback is torch.distributed's or DDP's
    (the call that raised was one of their collectives), or when the innermost frame of the
    functional collectives' module is their wait (``wait_tensor``): an error of another op on
    an AsyncCollectiveTensor (its ``__torch_dispatch__`` is in that module too) is not."""
    tb, last, in_wait = exc.__traceback__, None, False
    while tb is not None:
        code = tb.tb_frame.f_code
        last, tb = code.co_filename, tb.tb_next
        if last.endswith(_COLLECTIVE_WAIT):
            in_wait = code.co_name == "wait_tensor"
    return last is not None and (in_wait or any(part in last for part in _COLLECTIVE_CODE))


def _dist_errors() -> tuple[type, ...]:
    kinds: list[Any] = [getattr(dist, n, None) for n in
                        ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")]
    return tuple(k for k in kinds if isinstance(k, type))


__all__ = ["Agreement", "PeerFailure", "RecoveryStopped", "agree", "classify", "member_failed",
           "poll_collective"]
