"""ResumableSampler: a sampler's position in the epoch, saved per rank and restored exactly, also
when the number of data-parallel ranks changes.

With a DistributedSampler inside, rank r of W ranks takes positions r, r + W, r + 2W, ... of the
epoch's global order (DistributedSampler with num_replicas=1: the same permutation for the same
seed and epoch). After every rank consumed c indices, the first c * W positions of the global order
are consumed, whatever the rank. That global position is what carries over a change of world
size: the rest of the epoch, from that position on, is split again over the new ranks the way
DistributedSampler splits a whole epoch (padded by repeating its start, or cut with drop_last), so
no sample of the epoch is lost or seen twice beyond DistributedSampler's own padding.
"""

from __future__ import annotations

import itertools
import math
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler


class ResumableSampler(Sampler):
    """Wraps a sampler (e.g. DistributedSampler) and remembers the epoch and how many indices of
    it were consumed, so that a resumed run continues mid-epoch with the same order. The epoch
    advances by itself when an epoch is exhausted: do not call set_epoch() in the loop. Exact with
    a DataLoader with or without workers: with workers, the position is that of the batches the
    loop received (the DataLoader's count of batches it yielded, times the batch size), not of
    the indices its workers prefetched. A sampler with
    its own ``generator`` (RandomSampler(generator=...)) has that generator saved too; one that
    draws from the global RNG at each epoch's start is not exactly resumable.

    Around a DistributedSampler the position is also kept as a position in the epoch's global
    order, so a checkpoint saved by W ranks resumes on any number of ranks (build the
    DistributedSampler for the new world as usual), and ``reshard(num_replicas, rank)`` moves a
    running job to a new world mid-epoch (an iterator in progress switches at its next index).
    CheckpointManager.restore gives ranks without saved sampler state (a grown world) the others'
    position. A subclass of DistributedSampler (its own ``__iter__``) cannot be re-split: a world
    change raises ValueError."""

    def __init__(self, sampler: Any, epoch: int = 0):
        self.sampler = sampler
        self.epoch = epoch
        self.consumed = 0  # indices of the current split consumed by this rank
        self.offset = 0  # global position at which the current split of the epoch starts
        self.restored = False  # set by load_state_dict (CheckpointManager syncs fresh ranks)
        self._split = 0  # bumped by reshard(): an iterator in progress re-splits
        self._gen_state: torch.Tensor | None = None  # the inner generator at this epoch's start
        # The DataLoader iterator that drives the current iteration (a weak reference), and
        # (epoch, consumed, offset, split) when that iteration began, and how many indices it
        # has drawn: with workers, the loop is behind the indices drawn (prefetching).
        self._driver: Any = None
        self._began: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._drawn = 0
        self._exhausted = False

    def __len__(self) -> int:
        if self.offset == 0:
            return len(self.sampler)
        return len(self._rest_of_epoch())

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed, self.offset = epoch, 0, 0

    # -- the global position ---------------------------------------------------------------
    @property
    def distributed(self) -> DistributedSampler | None:
        """The wrapped DistributedSampler, or None when it wraps another sampler."""
        return self.sampler if isinstance(self.sampler, DistributedSampler) else None

    def _world(self) -> int:
        d = self.distributed
        return 1 if d is None else d.num_replicas

    def position(self) -> tuple[int, int]:
        """(epoch, global position): how many of the epoch's global order are consumed (by the
        loop: indices that DataLoader workers prefetched are not)."""
        epoch, consumed, offset, _ = self._received()
        return epoch, offset + consumed * self._world()

    def _received(self) -> tuple[int, int, int, bool]:
        """(epoch, consumed, offset, mid_iteration) as far as the training loop received
        batches. Without a DataLoader with workers, the sampler's own counters; with one, the
        iteration's start plus the batches the DataLoader yielded times its batch size
        (mid_iteration: True, the iteration's permutation is drawn).

        Raises ValueError where that count cannot be exact: batches out of order
        (DataLoader(in_order=False)), a batch sampler other than torch's BatchSampler, or a
        re-split (reshard) while workers still hold batches of the old split."""
        d = self._driver() if self._driver is not None else None
        if d is None or getattr(d, "_num_workers", 0) == 0:
            return self.epoch, self.consumed, self.offset, False
        epoch, consumed, offset, split = self._began
        if not getattr(d, "_in_order", True):
            raise ValueError(
                "ResumableSampler under DataLoader(num_workers>0, in_order=False): batches come "
                "back out of order, so which indices the loop received is unknown and a resume "
                "could not be exact; use in_order=True (the default) or "
                "torchdata's StatefulDataLoader saved in rank_state")
        index_sampler = getattr(d, "_index_sampler", None)
        drop_last = False
        if index_sampler is self:
            batch = 1
        elif isinstance(index_sampler, BatchSampler) and index_sampler.sampler is self:
            batch, drop_last = index_sampler.batch_size, bool(index_sampler.drop_last)
        else:
            raise ValueError(
                f"ResumableSampler under DataLoader(num_workers>0) with a batch sampler of type "
                f"{type(index_sampler).__name__}: the indices of the batches the loop received "
                "cannot be counted, so a resume could not be exact; use num_workers=0, torch's "
                "BatchSampler (DataLoader(batch_size=...)), or torchdata's StatefulDataLoader "
                "saved in rank_state")
        if split != self._split:
            raise ValueError(
                "ResumableSampler was re-split (reshard/set_position/load_state_dict) while a "
                "DataLoader's workers still hold batches of the old split; start a new iterator "
                "of the DataLoader (iter(loader)) after re-splitting, or use num_workers=0")
        received = min(int(d._num_yielded) * batch, self._drawn)
        # The epoch is the loop's once it received every batch the draws make (with drop_last,
        # the last partial batch never comes).
        whole = self._drawn // batch * batch if drop_last else self._drawn
        if self._exhausted and received >= whole:
            return self.epoch, self.consumed, self.offset, False  # the loop finished the epoch
        return epoch, consumed + received, offset, True

    def set_position(self, epoch: int, position: int) -> None:
        """Continues from global `position` of `epoch` on this rank's current split."""
        if position and self.distributed is None:
            raise ValueError("a global position needs a DistributedSampler inside")
        self._check_splittable(position)
        self.epoch, self.offset, self.consumed = int(epoch), int(position), 0
        self._split += 1

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Moves this rank to a world of `num_replicas` ranks mid-epoch: the rest of the epoch is
        split again over the new ranks from the global position reached so far (every rank must
        have consumed the same number of indices, as data-parallel ranks do)."""
        d = self.distributed
        if d is None:
            raise ValueError("reshard needs a DistributedSampler inside the ResumableSampler")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        epoch, position = self.position()
        self._check_splittable(position)
        d.num_replicas, d.rank = num_replicas, rank
        n = len(d.dataset)  # type: ignore[arg-type]
        if d.drop_last and n % num_replicas:
            d.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            d.num_samples = math.ceil(n / num_replicas)
        d.total_size = d.num_samples * num_replicas
        self.set_position(epoch, position)

    def _check_splittable(self, position: int) -> None:
        d = self.distributed
        if position and d is not None and type(d).__iter__ is not DistributedSampler.__iter__:
            raise ValueError(
                f"{type(d).__name__} has its own __iter__: the rest of an epoch cannot be split "
                "again over another number of ranks (resume on the same world size, or at an "
                "epoch boundary)")

    def _rest_of_epoch(self) -> list[int]:
        """This rank's indices of the epoch from global position `offset` on, split over the
        current ranks as DistributedSampler splits a whole epoch."""
        d = self.distributed
        assert d is not None
        order = DistributedSampler(d.dataset, num_replicas=1, rank=0, shuffle=d.shuffle,
                                   seed=d.seed, drop_last=False)
        order.set_epoch(self.epoch)
        rest = list(order)[self.offset:]
        world = d.num_replicas
        if d.drop_last:
            rest = rest[: len(rest) // world * world]
        elif rest and len(rest) % world:
            pad = world - len(rest) % world
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        return rest[d.rank::world]

    # -- iteration ----------------------------------------------------------------------------
    def _indices(self) -> Iterator[int]:
        """This rank's indices of the current split, from its start."""
        if self.offset:
            return iter(self._rest_of_epoch())
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        gen = self._generator()
        if gen is not None:
            if self._gen_state is not None and self.consumed:
                gen.set_state(self._gen_state)  # resuming: replay this epoch's permutation
            self._gen_state = gen.get_state()
        return iter(self.sampler)

    def __iter__(self) -> Iterator[int]:
        driver = _loader_iterator()
        self._driver = weakref.ref(driver) if driver is not None else None
        self._began = (self.epoch, self.consumed, self.offset, self._split)
        self._drawn, self._exhausted = 0, False
        while True:
            split = self._split
            for index in itertools.islice(self._indices(), self.consumed, None):
                if self._split != split:
                    break
                self.consumed += 1
                self._drawn += 1
                yield index
                if self._split != split:
                    break
            if self._split == split:
                break
        self.epoch, self.consumed, self.offset = self.epoch + 1, 0, 0
        self._exhausted = True

    def _generator(self) -> torch.Generator | None:
        gen = getattr(self.sampler, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        epoch, consumed, offset, mid_iteration = self._received()
        state: dict[str, Any] = {"epoch": epoch, "consumed": consumed}
        if self.distributed is not None:
            state["world"], state["offset"] = self._world(), offset
        gen = self._generator()
        if gen is not None:
            # A sampler with its own generator (RandomSampler) draws each epoch's order from it:
            # keep its state at the start of the current epoch (or now, between epochs).
            started = consumed or mid_iteration
            state["generator"] = self._gen_state if started else gen.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        world, offset = int(state.get("world", self._world())), int(state.get("offset", 0))
        if world != self._world():
            # saved by another number of ranks: continue from the global position
            self.set_position(epoch, offset + consumed * world)
        else:
            self.epoch, self.consumed, self.offset = epoch, consumed, offset
            self._split += 1
        gen = self._generator()
        if gen is not None and "generator" in state:
            if self.consumed:
                self._gen_state = state["generator"].clone()
            else:
                gen.set_state(state["generator"])
        self.restored = True


def _loader_iterator() -> Any:
    """The DataLoader iterator whose pull runs the calling generator (a frame up the stack whose
    ``self`` is one), or None when the sampler is iterated otherwise."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        me = frame.f_locals.get("self")
        if isinstance(me, _BaseDataLoaderIter):
            return me
        frame = frame.f_back
    return None


def samplers_in(state: Any) -> list[ResumableSampler]:
    """The ResumableSamplers in a (nested) rank_state, in a fixed order."""
    if isinstance(state, ResumableSampler):
        return [state]
    if isinstance(state, dict):
        return [s for k in sorted(state, key=str) for s in samplers_in(state[k])]
    if isinstance(state, (list, tuple)):
        return [s for v in state for s in samplers_in(v)]
    return []
