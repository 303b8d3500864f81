"""How the per-window summaries reach every rank.

Every `interval` steps each rank contributes one row [steps, step_s, compute_s, host_s, wait_s];
the exchange returns the rows of all ranks. TorchExchange issues one asynchronous all_gather of
that small tensor and the monitor polls it on later steps, so no step ever waits for the others
because of the monitor (it waits only if a summary is still in flight a whole window later, with a
deadline). LocalExchange serves tests and single-process simulations.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Protocol

ROW_WIDTH = 5
#: The straggler exchange's own gloo group (NCCL jobs): its collectives' timeout, seconds.
GROUP_TIMEOUT_S = 120.0


class PendingRows(Protocol):
    """A summary exchange in flight."""

    def done(self) -> bool:
        """True when result() will not block."""

    def result(self, timeout_s: float) -> list[list[float]]:
        """All ranks' rows; raises TimeoutError after `timeout_s` seconds."""


class SummaryExchange(Protocol):
    """Exchanges one row per rank per window."""

    rank: int
    world_size: int

    def start(self, row: Sequence[float]) -> PendingRows:
        """Begins exchanging this rank's row; every rank must call it for the same window."""


class _Ready:
    def __init__(self, rows: list[list[float]]):
        self._rows = rows

    def done(self) -> bool:
        return True

    def result(self, timeout_s: float) -> list[list[float]]:
        return self._rows


class LocalExchange:
    """An exchange without communication: `gather(rank, row)` returns every rank's row.

    With the default gather the world is this one rank.
    """

    def __init__(self, rank: int = 0, world_size: int = 1,
                 gather: Callable[[int, list[float]], list[list[float]]] | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self._gather = gather or (lambda _rank, row: [row])

    def start(self, row: Sequence[float]) -> PendingRows:
        rows = self._gather(self.rank, list(row))
        if len(rows) != self.world_size:
            raise ValueError(f"gather returned {len(rows)} rows for a world of {self.world_size}")
        return _Ready(rows)


class _TorchPending:
    def __init__(self, work, outputs):
        self._work = work
        self._outputs = outputs

    def done(self) -> bool:
        return self._work.is_completed()

    def result(self, timeout_s: float) -> list[list[float]]:
        try:  # also when completed: a failed all_gather raises here, not a row of garbage
            self._work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:  # gloo and NCCL report a deadline as RuntimeError
            raise TimeoutError(f"straggler summary exchange: {e}") from e
        return [t.tolist() for t in self._outputs]


class TorchExchange:
    """One asynchronous all_gather of a 5-float64 tensor per window over a CPU (gloo) group.

    Args:
        group: the process group to use. None: the default group, followed: the default group
            if its backend is gloo, else a new gloo group over its ranks, created here (a
            collective call: every rank must construct its monitor); when in-process recovery
            replaces the default group (a rank lost or joined), ``refresh()`` moves the exchange
            onto the new one (collective over the new group, at the same window on every rank).
    """

    def __init__(self, group=None):
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; use LocalExchange")
        self._torch = torch
        self._dist = dist
        self._follow = group is None
        self._default = None
        self._group = None
        self._use(group)

    def _use(self, group) -> None:
        dist = self._dist
        if self._follow:
            self._default = dist.distributed_c10d._get_default_group()
            if self._group is not None:  # ours, over a group recovery gave up: never destroyed
                from resilient.comm import retire_groups  # here (its gloo worker may wait on a

                retire_groups([self._group])  # dead peer until the group's timeout)
            group = None
            if dist.get_backend() != "gloo":  # NCCL: a gloo group of our own, connecting lazily
                import datetime  # (a peer lost meanwhile is met in a polled collective, not in

                from resilient.comm import gloo_lazy_init  # an eager connect)

                with gloo_lazy_init():
                    group = dist.new_group(backend="gloo",
                                           timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def refresh(self) -> bool:
        """Follows the default group (group=None): True when it was replaced since the last
        call (the exchange now runs over the new group's ranks, renumbered)."""
        if not self._follow or not self._dist.is_initialized():
            return False
        if self._dist.distributed_c10d._get_default_group() is self._default:
            return False
        self._use(None)
        return True

    def start(self, row: Sequence[float]) -> PendingRows:
        torch = self._torch
        mine = torch.tensor(list(row), dtype=torch.float64)
        outputs = [torch.empty(ROW_WIDTH, dtype=torch.float64) for _ in range(self.world_size)]
        work = self._dist.all_gather(outputs, mine, group=self._group, async_op=True)
        return _TorchPending(work, outputs)
