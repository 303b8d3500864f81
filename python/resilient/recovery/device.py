"""A rank whose device is lost: a sticky CUDA error (an illegal address, a device-side assert, a
launch failure, an uncorrectable ECC error) poisons the process's CUDA context, and every later
CUDA call in that process fails. In-process recovery cannot go on in such a process: it must be
replaced by a fresh one.

After a step fails, Recovery asks :func:`lost` whether the failure is of that kind: the error (or
one it was raised from) is a ``torch.AcceleratorError``, or a collective error (NCCL reports a
CUDA failure inside its kernels as one), *and* the device no longer works (:func:`probe`: a
stream query and a one-element kernel, neither of which waits for the work in flight, so a
collective stuck on a dead peer does not block it). An error after which the device still works
(an invalid argument, a kernel given a bad shape) is the program's own and is raised as before.

The rank then leaves: it logs why, stops its detector (the peers' verdict follows from the
silence) and exits with :data:`EXIT_DEVICE_LOST` without running Python's teardown, which could
hang on the poisoned context (NCCL communicators, the caching allocator). ``resilient run``
restarts that rank alone (``--max-restarts``, or ``--replacements``; a waiting ``--spares`` rank
is used first): the new process joins the running job and takes its state from its peers'
memory, as a replacement does (resilient.recovery.join).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

#: The exit status of a rank whose device is lost (EX_TEMPFAIL: try again, in a new process).
EXIT_DEVICE_LOST = 75


def probe(device: torch.device) -> None:
    """Raises when ``device`` cannot run work any more (a sticky error); returns at once
    otherwise. Only CUDA devices can be lost; this is the seam a test replaces to emulate one."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).query()
        torch.empty(1, device=device).add_(1)


def load_probe(device: torch.device) -> None:
    """Runs :func:`probe` once, at start: CUDA loads a kernel's module at its first launch
    (lazy loading), and that load waits while a collective kernel stuck on a dead peer runs,
    so a first probe during a recovery could block (seen with HSDP on 4 H200s)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            probe(device)
            torch.cuda.current_stream(device).synchronize()


def _accelerator_error(exc: BaseException) -> bool:
    kind = getattr(torch, "AcceleratorError", None)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and kind is not None:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def lost(exc: BaseException, device: torch.device, *, collective_error: bool) -> str | None:
    """Why ``device`` is lost, when the failure ``exc`` of a step left it unusable; None when
    the device works (or ``exc`` cannot come from it). ``collective_error``: ``exc`` is a
    collective's error (Recovery's classification)."""
    if not (_accelerator_error(exc) or collective_error):
        return None
    try:
        probe(device)
    except Exception as err:  # noqa: BLE001 -- any failure of the probe means the same
        code = getattr(err, "error_code", None)
        first = (str(err).splitlines() or [""])[0]
        return f"{type(err).__name__}{f' {code}' if code is not None else ''}: {first}"
    return None


def leave(code: int = EXIT_DEVICE_LOST) -> None:
    """Ends the process at once (no atexit handlers, no destructors: they could hang on the
    poisoned context), after flushing what it printed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 -- a closed stream must not keep us here
            pass
    os._exit(code)


def describe(rank: int, device: Any, why: str) -> str:
    return (f"rank {rank}: {device} is lost ({why}); in-process recovery cannot go on in this "
            f"process. It exits with {EXIT_DEVICE_LOST} so that `resilient run` restarts this "
            "rank alone (--max-restarts or --replacements; a waiting spare takes its place "
            "first): the new process rejoins the job and takes its state from its peers")


__all__ = ["EXIT_DEVICE_LOST", "describe", "leave", "load_probe", "lost", "probe"]
