"""How fast this machine runs the tests right now, so that their deadlines follow it.

A test's deadline is what the code under test may take on an idle 2-core VM (the CI machine's
size), stretched by two measured factors, never shrunk:

- speed: the machine's single-core speed against that VM's (a fixed piece of work, timed a few
  times at the first call; the fastest run counts, which load cannot make faster);
- pressure: the CPU pressure now (Linux PSI, /proc/pressure/cpu): the share of the last 10 s in
  which runnable tasks waited for a CPU. A test that gets half the CPU takes twice as long.

``startup(n)`` is the time n processes that import torch need to start on this machine's cores
(2.5 CPU-seconds each on that VM). ``stall_share`` tells, after the fact, how much of a stretch
of time the machine's tasks spent waiting for a CPU: conftest reports a failed multi-process
test that ran starved as such.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

#: The fixed piece of work's time on an idle core of the 2-core CI VM (seconds).
REFERENCE_WORK_S = 0.0095
#: CPU-seconds a Python process spends importing torch there.
TORCH_IMPORT_S = 2.5
#: The most a deadline is stretched (a test still ends if the machine is hopelessly loaded).
MAX_STRETCH = 8.0


def _work() -> float:
    t = time.perf_counter()
    h = hashlib.sha256()
    block = b"x" * 4096
    for _ in range(4096):
        h.update(block)
    return time.perf_counter() - t


@functools.lru_cache(maxsize=1)
def speed() -> float:
    """How many times slower than the reference VM's core this machine's core is (>= 1)."""
    return max(1.0, min(_work() for _ in range(5)) / REFERENCE_WORK_S)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _psi() -> tuple[float, int] | None:
    """(some avg10 in %, some total in microseconds) of /proc/pressure/cpu, or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            line = f.readline().split()
    except OSError:
        return None
    fields = dict(part.split("=") for part in line[1:])
    return float(fields["avg10"]), int(fields["total"])


def pressure() -> float:
    """How much slower than on an idle machine work runs now (>= 1), from the CPU pressure."""
    psi = _psi()
    if psi is None:
        return 1.0
    waiting = min(0.85, psi[0] / 100.0)
    return 1.0 / (1.0 - waiting)


def deadline(seconds: float) -> float:
    """`seconds` of work on the idle reference VM, stretched for this machine and its load."""
    return seconds * min(MAX_STRETCH, speed() * pressure())


def startup(processes: int = 1) -> float:
    """Seconds for `processes` Python processes that import torch to start here, now."""
    rounds = max(1.0, processes / cores())
    return deadline(1.0 + TORCH_IMPORT_S * rounds)


def stall_counter() -> int | None:
    """PSI's total stall time so far (microseconds), for stall_share()."""
    psi = _psi()
    return None if psi is None else psi[1]


def stall_share(before: int | None, after: int | None, seconds: float) -> float | None:
    """The share (0..1) of `seconds` in which some task waited for a CPU, between two
    stall_counter() readings; None where PSI is not available."""
    if before is None or after is None or seconds <= 0:
        return None
    return min(1.0, (after - before) / 1e6 / seconds)
