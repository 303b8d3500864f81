"""What the survivors do with a smaller (or larger) world: pure decisions, no torch.

Three policies (``RecoveryConfig.policy`` / ``RESILIENT_RECOVERY_POLICY``):

* ``keep_batch`` (default): the global batch stays the same. Each rank runs more micro-batches
  (gradient accumulation); when the global batch does not divide evenly, micro-batch sizes differ
  by at most one sample and the loss is scaled so that the gradient is still the mean over exactly
  ``global_batch`` samples.
* ``scale_lr``: every rank keeps its micro-batch and accumulation, so the global batch shrinks in
  proportion to the world; the learning rate is scaled by the same factor (linear scaling rule).
* ``none``: keep micro-batches and the learning rate (the global batch shrinks).

Whatever the policy, fewer than ``min_world_size`` ranks stop the job with a message naming the
sizes (``decide`` returns ``Decision(stop=True, ...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("keep_batch", "scale_lr", "none")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one rank in one step.

    ``offset`` is the position of its first sample in the step's global batch, so the data a
    step sees does not depend on the world size; ``loss_scale`` turns the mean loss over this
    micro-batch into its share of the global mean once DDP averages over the ranks.
    """

    index: int
    size: int
    offset: int
    loss_scale: float

    @property
    def slice(self) -> slice:
        """The samples of this micro-batch within the step's global batch."""
        return slice(self.offset, self.offset + self.size)


@dataclass(frozen=True)
class BatchPlan:
    """How a step's ``global_batch`` samples are spread over ``world`` ranks.

    ``sizes[r]`` are rank r's micro-batch sizes. Ranks get ``global_batch // world`` samples
    (the first ``global_batch % world`` one more), each split into as few micro-batches of at most
    ``micro_batch`` as possible, with sizes differing by at most one. Ranks may run different
    numbers of micro-batches: each still runs exactly one synchronizing backward (its last).
    """

    world: int
    global_batch: int
    sizes: tuple = field(default_factory=tuple)

    @property
    def accum_steps(self) -> int:
        """The most micro-batches any rank runs per step."""
        return max(len(s) for s in self.sizes)

    def micro_batches(self, rank: int) -> list[MicroBatch]:
        """Rank ``rank``'s micro-batches, in order."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of {self.world}")
        out = []
        offset = sum(sum(s) for s in self.sizes[:rank])
        for i, size in enumerate(self.sizes[rank]):
            # mean loss x size x world / global_batch: after DDP divides the summed gradients
            # by the world, every sample weighs 1 / global_batch.
            out.append(MicroBatch(i, size, offset, size * self.world / self.global_batch))
            offset += size
        return out


def _split(n: int, parts: int) -> tuple:
    base, extra = divmod(n, parts)
    return tuple(base + (1 if k < extra else 0) for k in range(parts))


def plan_whole_batches(global_batch: int, micro_batch: int, world: int) -> BatchPlan:
    """A plan for a loop that draws whole batches of ``micro_batch`` samples from its own
    DataLoader (``Recovery(samplers=...)``): every rank runs the same number k of full
    micro-batches (so the samplers stay at one global position), k the whole number of batches
    per rank nearest to ``global_batch / (world * micro_batch)`` (at least 1, halves up). The
    global batch is then ``k * world * micro_batch``: ``global_batch`` itself when it divides.

    Raises:
        ValueError: a non-positive argument.
    """
    if global_batch <= 0 or micro_batch <= 0 or world <= 0:
        raise ValueError(
            f"need positive sizes, got global_batch={global_batch} "
            f"micro_batch={micro_batch} world={world}"
        )
    k = max(1, (2 * global_batch + world * micro_batch) // (2 * world * micro_batch))
    return BatchPlan(world, k * world * micro_batch, tuple((micro_batch,) * k
                                                           for _ in range(world)))


def plan_batch(global_batch: int, micro_batch: int, world: int) -> BatchPlan:
    """Spreads ``global_batch`` samples over ``world`` ranks in micro-batches of at most
    ``micro_batch`` samples (see :class:`BatchPlan`).

    Raises:
        ValueError: a non-positive argument, or fewer samples than ranks.
    """
    if global_batch <= 0 or micro_batch <= 0 or world <= 0:
        raise ValueError(
            f"need positive sizes, got global_batch={global_batch} "
            f"micro_batch={micro_batch} world={world}"
        )
    if global_batch < world:
        raise ValueError(f"global batch {global_batch} smaller than the world ({world})")
    shares = _split(global_batch, world)
    sizes = tuple(_split(share, -(-share // micro_batch)) for share in shares)
    return BatchPlan(world, global_batch, sizes)


@dataclass(frozen=True)
class Decision:
    """The outcome of ``decide``: stop, or continue with this batch plan and LR factor."""

    stop: bool
    message: str
    plan: BatchPlan | None = None
    lr_factor: float = 1.0


def decide(
    policy: str,
    *,
    initial_world: int,
    world: int,
    min_world_size: int,
    global_batch: int,
    micro_batch: int,
    whole_batches: bool = False,
) -> Decision:
    """The policy's answer for a world of ``world`` ranks (the job started with
    ``initial_world``; ``global_batch`` is the initial global batch per step). With
    ``whole_batches`` (a loop drawing batches of ``micro_batch`` from samplers) every plan is
    :func:`plan_whole_batches`, and keep_batch keeps the nearest global batch it can.

    Raises:
        ValueError: unknown policy or bad sizes.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown recovery policy {policy!r} (one of {', '.join(POLICIES)})")
    if initial_world <= 0 or global_batch <= 0 or micro_batch <= 0:
        raise ValueError("initial_world, global_batch and micro_batch must be positive")
    if world < max(1, min_world_size):
        return Decision(
            True,
            f"only {world} of {initial_world} ranks remain, fewer than the "
            f"minimum world size {min_world_size}: stopping",
        )
    plan_for = plan_whole_batches if whole_batches else plan_batch
    if policy == "keep_batch":
        plan = plan_for(global_batch, micro_batch, world)
        kept = ("kept" if plan.global_batch == global_batch else
                f"-> {plan.global_batch} (the nearest whole number of batches of "
                f"{micro_batch} per rank)")
        return Decision(
            False,
            f"world {initial_world} -> {world}: global batch {global_batch} "
            f"{kept} with {plan.accum_steps} accumulation step(s)",
            plan,
        )
    if global_batch % initial_world:
        raise ValueError(
            f"policy {policy!r} needs a global batch ({global_batch}) divisible by "
            f"the initial world ({initial_world})"
        )
    # Each rank keeps its share (and so its micro-batches and accumulation steps).
    plan = plan_for(global_batch // initial_world * world, micro_batch, world)
    factor = world / initial_world if policy == "scale_lr" else 1.0
    return Decision(
        False,
        f"world {initial_world} -> {world}: global batch {plan.global_batch}, "
        f"learning rate x{factor:.4g}",
        plan,
        factor,
    )


__all__ = ["EXIT_EVICTED", "POLICIES", "BatchPlan", "Decision", "MicroBatch", "decide",
           "plan_batch", "plan_whole_batches"]


#: The exit status of a rank that the other ranks removed from the job (its failure detector
#: learned it was evicted: it had been frozen, stopped, cut off or stalled past its hang limit)
#: or that removed itself as a persistent straggler. The job goes on without it: ``resilient
#: run`` counts it as neither a failure nor a finish. Distinct from EXIT_DEVICE_LOST (75:
#: restart me in a fresh process) and RecoveryStopped's 3 (the job cannot go on).
EXIT_EVICTED = 76

#: The exit status of a rank that removed itself as a persistent straggler (a removal, as above;
#: it was 75, which ``resilient run`` takes for a lost device and restarts).
STRAGGLER_EXIT_CODE = EXIT_EVICTED


def exclude_persistent_straggler(
    recovery: Any, exit_fn: Callable[[int], None] | None = None, log: Callable[[str], None] = print
) -> Callable[[int, Any], None]:
    """A ``StragglerMonitor(on_persistent_straggler=...)`` policy that removes a persistent
    straggler through the recovery loop.

    Every rank runs the same straggler detector on the same gathered numbers, so every rank
    receives the same ``(rank, report)``. The named rank leaves by ending its own process; the
    survivors' recovery loop sees a dead rank, agrees on the new membership, shrinks the process
    group and continues (the tested kill path), and the job's world-size policy applies. Other
    ranks do nothing. ``recovery`` is anything with a ``rank`` attribute holding this process's
    rank in the group the monitor gathers over (a ``Recovery``).
    """
    import os

    exit_now = exit_fn if exit_fn is not None else os._exit

    def policy(rank: int, report: Any) -> None:
        if rank != recovery.rank:
            return
        log(f"resilient: rank {rank} is a persistent straggler ({report}); leaving the job")
        exit_now(STRAGGLER_EXIT_CODE)

    return policy
