"""A few lines around a training loop: periodic async checkpoints and exact resume.

    from resilient import CheckpointManager, ResumableSampler

    sampler = ResumableSampler(DistributedSampler(dataset, seed=0))
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    ckpt = CheckpointManager("/ckpt", {"model": model, "optim": opt, "sched": sched},
                             rank_state={"sampler": sampler}, every=100, create=True)
    step = ckpt.restore()              # 0 on a fresh start; RNG, sampler, model ... restored
    for batch in forever(loader):      # or any loop
        ...train one step...
        step += 1
        ckpt.step(step)                # saves asynchronously every `every` steps
        if step == total: break
    ckpt.close()                       # waits for the last save to commit

The manager is a thin loop helper over resilient.Checkpointer (collective and sharded under
torch.distributed with more than one rank, one process otherwise). It reads the live objects at
every save, so the state must be live: modules, optimizers, schedulers, tensors, or a callable
that returns the state. RNG streams (Python, NumPy, torch CPU and CUDA) are saved per rank unless
rng=False.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from resilient.checkpoint import Checkpointer, ShardSpec
from resilient.checkpoint.codec import is_stateful
from resilient.checkpoint.sampler import ResumableSampler, samplers_in

log = logging.getLogger("resilient.checkpoint.manager")


class RNGState:
    """Stateful view of the process's random number generators: Python's ``random``, NumPy's
    global generator, torch's CPU generator and every CUDA device's generator (when present)."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state(
            (kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
        )
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))


def forever(loader: Any) -> Iterator[Any]:
    """Yields batches from `loader` epoch after epoch (pair with ResumableSampler).

    Raises ValueError when a whole epoch yields no batch (fewer samples than one batch with
    drop_last=True, an empty dataset), instead of looping forever."""
    empty = 0
    while True:
        got = False
        for batch in loader:
            got = True
            yield batch
        empty = 0 if got else empty + 1
        if empty >= 2:  # a resumed epoch may have had nothing left; a whole one may not
            raise ValueError(
                f"{type(loader).__name__} yielded no batch in a whole epoch (a dataset smaller "
                "than one batch with drop_last=True, or an empty one): forever() would never "
                "yield")


def require_live(state: Any, what: str) -> None:
    """Raises TypeError for a plain value in `state`: one captured once (an optimizer's or
    scheduler's state_dict() is a copy) would be saved unchanged at every step, and a load
    into it would restore nothing into the object it came from."""

    def walk(x: Any, path: str) -> None:
        if isinstance(x, (torch.Tensor, np.ndarray)) or is_stateful(x):
            return
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}[{k!r}]")
            return
        if isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
            return
        raise TypeError(
            f"{what}{path} is a plain {type(x).__name__}: the manager saves the state as it is at "
            "each save and loads into it in place, so it must hold live objects (modules, "
            "optimizers, schedulers, tensors) - not a state_dict() taken once (an optimizer's or "
            "scheduler's is a copy). Pass the object itself, or a callable that returns the "
            "state's objects."
        )

    walk(state, "")


class CheckpointManager:
    """Periodic asynchronous checkpoints and exact resume for a training loop.

    Args:
        root: checkpoint directory (shared by all ranks).
        state: what data-parallel replicas share, as live objects: modules (DDP or not),
            optimizers, schedulers, tensors, containers of them; or a callable returning that.
            Under DDP it is written once in total, split across ranks.
        rank_state: per-rank state (a ResumableSampler, custom counters); RNG streams are added
            as "rng" unless rng=False.
        every: save when step % every == 0 (step() calls); 0 disables periodic saves.
        keep: committed checkpoints kept.
        create: the run may start fresh (see Checkpointer); without it, restore() raises
            CheckpointNotFoundError for a root that does not exist (a mistyped path).
        specs: ShardSpec per tensor name for tensor-parallel shards (see docs/training.md).
        options: further Checkpointer options.
    """

    def __init__(
        self,
        root: str,
        state: Any,
        rank_state: dict[str, Any] | None = None,
        *,
        every: int = 100,
        keep: int = 3,
        rng: bool = True,
        create: bool = False,
        specs: dict[str, ShardSpec] | None = None,
        **options: Any,
    ):
        if not callable(state) or is_stateful(state):
            require_live(state, "CheckpointManager state")
        self.state = state
        self.rank_state = dict(rank_state or {})
        require_live(self.rank_state, "CheckpointManager rank_state")
        if rng:
            self.rank_state.setdefault("rng", RNGState())
        self.every = every
        # A manager saves: its checkpointer takes the root's writer lock when it is made
        # (unless this process cannot be the writer yet: see Checkpointer's `writer`).
        self._args = (root, dict(keep=keep, create=create, specs=specs, writer=True, **options))
        self._ckpt = Checkpointer(root, **self._args[1])
        self.distributed = self._ckpt.world_size > 1

    def abort(self, reason: str) -> None:
        """For in-process recovery, on the detector's verdict (safe from its thread): a save
        entering now or waiting for its peers raises CollectiveError at once on every rank
        (Ranks.abort), and the saves in flight stop waiting for the lost rank
        (Checkpointer.abandon_in_flight)."""
        try:
            self._ckpt._ranks.abort(reason)
            self._ckpt.abandon_in_flight(reason)
        except Exception as e:  # noqa: BLE001 -- the store is gone: the timeouts end the waits
            log.warning("cannot abort the checkpoint's collectives: %s", e)

    def regroup(self, lost_rank: bool, timeout: float | None = None, *,
                group: Any = None) -> list[int]:
        """Collective over the new group. Moves the manager onto the current default process
        group after in-process recovery rebuilt it (resilient.recovery.Recovery calls this;
        users do not): with ``lost_rank`` the saves in flight are abandoned, since the lost
        rank's shard will never arrive (Checkpointer.abandon); without (a rank joined), they are
        first waited for (up to ``timeout``, default the checkpointer's). The root keeps every
        committed checkpoint; the next save is written by the new group's ranks. Returns the
        steps whose saves did not commit. ``group``: a gloo group over the new group's ranks
        for the checkpointer's collectives (default: one of its own, created here).

        Raises:
            TimeoutError: a save still running after ``timeout`` (the old checkpointer keeps
                the root; see Checkpointer.abandon).
        """
        old = self._ckpt
        if lost_rank:
            lost = old.abandon("a rank of the group was lost", timeout)
        else:
            handles = list(old._in_flight)
            old._no_tier_wait = True  # recovery does not wait for copies to slower tiers
            try:
                old.close(old.timeout if timeout is None else timeout)
            except TimeoutError:
                raise
            except Exception as e:  # noqa: BLE001 -- reported; the new group saves anew
                log.error("a save before the group grew did not commit: %s", e)
            lost = [h.step for h in handles if h._error is not None]
        root, kwargs = self._args
        self._ckpt = Checkpointer(root, **{**kwargs, "create": True, "group": group,
                                           "takeover": lost_rank})
        self.distributed = self._ckpt.world_size > 1
        if lost:
            log.warning("checkpoint saves of steps %s were not committed (the group changed); "
                        "the next save writes a complete checkpoint", lost)
        return lost

    @property
    def checkpointer(self) -> Checkpointer:
        return self._ckpt

    def _state(self) -> Any:
        return self.state() if callable(self.state) and not is_stateful(self.state) else self.state

    def restore(self, step: int | None = None, *, strict: bool = True) -> int:
        """Loads the newest checkpoint of the lineage (or `step`) into the state; returns its
        step, 0 for a fresh root. Raises like Checkpointer.load.

        In a process that ``resilient run`` started to join a running job (a spare or a
        replacement: ``RESILIENT_JOIN=1``), nothing is read and 0 is returned: its state comes
        from the job's members when Recovery admits it, and reading the checkpoint in its
        one-rank group before that would load every rank's shards into this one."""
        from resilient.recovery.environment import JOIN_ENV

        if step is None and os.environ.get(JOIN_ENV) == "1":
            log.info("this process joins a running job: its state comes from the members, "
                     "the checkpoint is not read")
            return 0
        state = self._state()
        require_live(state, "CheckpointManager state")
        samplers = samplers_in(self.rank_state)
        for s in samplers:
            s.restored = False
        got = self._ckpt.load(state, self.rank_state, step=step, strict=strict)
        if got is not None:
            log.info("resumed from checkpoint step %d", got)
            if self.distributed:
                self._sync_samplers(samplers)
        return got or 0

    def _sync_samplers(self, samplers: list[ResumableSampler]) -> None:
        """Collective. A rank whose per-rank state was not in the checkpoint (the world grew)
        takes the epoch and global position of the ranks that restored theirs; restored ranks
        that disagree (they consumed different numbers of indices) raise ValueError."""
        mine = [s.position() if s.restored else None for s in samplers
                if s.distributed is not None]
        everyone = self._ckpt._ranks.gather(mine)
        if any(len(g) != len(mine) for g in everyone):
            raise ValueError("ranks hold different numbers of ResumableSamplers in rank_state")
        samplers = [s for s in samplers if s.distributed is not None]
        for i, s in enumerate(samplers):
            known = {g[i] for g in everyone if g[i] is not None}
            if len(known) > 1:
                raise ValueError(
                    f"the restored samplers are at different positions of the epoch "
                    f"({sorted(known)}: (epoch, global position)); data-parallel ranks must "
                    "consume the same number of indices")
            if known and not s.restored:
                s.set_position(*known.pop())

    def step(self, step: int) -> Any:
        """Call once per training step; saves (asynchronously) when step % every == 0."""
        if self.every > 0 and step > 0 and step % self.every == 0:
            return self.save(step)
        return None

    def save(self, step: int) -> Any:
        """Saves now; returns the handle. Raises the previous save's error, if it failed."""
        return self._ckpt.save(step, self._state(), self.rank_state)

    def wait(self, timeout: float | None = None) -> None:
        """Waits until every save so far is committed; raises the first failure."""
        self._ckpt.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._ckpt.close(timeout)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
