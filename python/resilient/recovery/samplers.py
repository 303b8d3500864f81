"""The user's DataLoader samplers under in-process recovery: each ResumableSampler (around a
DistributedSampler) is rewound to where the interrupted step began and its epoch re-split over the
new group, so a recovered step draws the same samples again and no sample of the epoch is lost or
seen twice (resilient.checkpoint.sampler has the arithmetic)."""

from __future__ import annotations

from typing import Any

from resilient.checkpoint.sampler import ResumableSampler


class Samplers:
    """The samplers Recovery keeps in step with the group (``Recovery(samplers=[...])``)."""

    def __init__(self, samplers: list[Any] | None) -> None:
        self.items: list[ResumableSampler] = list(samplers or [])
        for s in self.items:
            if not isinstance(s, ResumableSampler) or s.distributed is None:
                raise TypeError("Recovery(samplers=...) takes ResumableSampler(DistributedSampler"
                                f"(...)) objects, not {type(s).__name__}")
        self._start: list[tuple[int, int]] = []
        self._start_step = -1

    def begin(self, step: int) -> None:
        """A step starts: remember every sampler's position, to rewind to if it fails."""
        self._start, self._start_step = [s.position() for s in self.items], step

    def start_of(self, step: int) -> list[tuple[int, int]]:
        """(epoch, global position) of each sampler where `step` begins (or began)."""
        if self._start_step == step:
            return list(self._start)
        return [s.position() for s in self.items]

    def state(self, step: int) -> dict[str, Any]:
        """start_of(step) as broadcastable state (a dict of ints)."""
        return {str(i): {"epoch": e, "position": p} for i, (e, p) in enumerate(self.start_of(step))}

    def set_state(self, state: dict[str, Any], step: int) -> None:
        """Takes another member's start_of(step) (received through broadcast_state)."""
        self._start = [(int(state[str(i)]["epoch"]), int(state[str(i)]["position"]))
                       for i in range(len(self.items))]
        self._start_step = step

    def reshard(self, world: int, rank: int, step: int) -> None:
        """Re-splits every sampler over `world` ranks from where `step` begins."""
        start = self.start_of(step)
        for s, (epoch, position) in zip(self.items, start):
            s.reshard(world, rank)
            s.set_position(epoch, position)
        self._start, self._start_step = start, step
