"""The user's own loop, protected step by step (the alternative to ``Recovery.run(loss_fn)``)::

    for step in rec.steps(start, end):      # yields a step again after a recovery
        with rec.attempt():                 # a peer's failure here: recover, redo the step
            opt.zero_grad()
            for mb in rec.micro_batches():  # this rank's share of the global batch (no_sync
                x, y = batch(step)          # on all but the last micro-batch)
                loss = F.mse_loss(rec.model(x[mb.slice]), y[mb.slice]) * mb.loss_scale
                loss.backward()
            opt.step()
            sched.step()

Why a step can be redone: the gradient all-reduce runs inside ``backward`` (Recovery's DDP comm hook
polls it to completion on the gloo path; on NCCL the optimizer gate below waits for it), so when a
peer fails the exception leaves the block before ``opt.step()``: parameters, optimizer and scheduler
are those of the step's start, as with ``run``. ``attempt`` classifies the exception like ``run`` (a
peer failure is recovered, anything else propagates), and after a recovery ``steps`` yields the same
step again on the rebuilt group. The loop must use ``rec.model`` (the DDP wrapper changes with the
group) and ``rec.rank``/``rec.world_size`` or ``rec.micro_batches()`` for its share of the data.

On GPU (NCCL) the all-reduce is asynchronous on NCCL's stream, so ``backward`` returns before
it completed; Recovery gates ``optimizer.step()`` with a step pre-hook that polls a CUDA event
while watching the detector's verdict: a failed step leaves before the update is queued. When the
verdict arrives while a step runs, the detector's thread revokes the NCCL groups (or aborts
them), so a CUDA sync in the step (``loss.item()`` after ``backward``, GradScaler's inf check)
returns instead of hanging; the gate then fails the step. A failure after ``optimizer.step()``
(a collective of the user's own, for logging) keeps the applied step: it is not redone. A
DataLoader over a ``ResumableSampler(DistributedSampler(...))`` passed as
``Recovery(samplers=[...])`` is rewound to the failed step's start and re-split over the new
group (docs/recovery.md, "The user's DataLoader").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from resilient.recovery.decisions import RecoveryStopped
from resilient.recovery.policy import MicroBatch


class StepLoop:
    """``steps``, ``attempt`` and ``micro_batches`` for :class:`resilient.recovery.Recovery`
    (which provides the state and the ``_begin_step``/``_end_step`` halves of a step)."""

    step: int
    model: Any
    plan: Any
    rank: int
    _in_step: bool
    _applied: bool
    _pending_cause: str | None

    def steps(self, start: int | None, end: int) -> Iterator[int]:
        """Yields the step to run, from ``start`` (None: ``self.step``; a rank that joined a
        running job continues from the job's step) to ``end - 1``; a step whose ``attempt``
        recovered from a failure is yielded again. Starts the Recovery if no ``with rec:``
        did, and then closes it when the loop ends (or is left by an exception)."""
        own = not self.started  # type: ignore[attr-defined]
        if start is not None and not (self.joined or self._join_on_start):  # type: ignore[attr-defined]
            self.step = start
        if own:
            self.start()  # type: ignore[attr-defined]
        try:
            while self.step < end:
                yield self.step
            self._finished()  # type: ignore[attr-defined]
        finally:
            if own:
                self.close()  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Protects one step of the user's loop (module docstring): on success the step counts
        (detector heartbeat, checkpoint, joiners admitted); on a peer's failure the group is
        rebuilt and the exception suppressed, so ``steps`` yields the step again.

        Raises:
            RecoveryStopped: too few ranks, this rank was evicted, or too many recoveries.
        """
        self._gate_optimizer()  # type: ignore[attr-defined]
        self._applied = False
        self._in_step = True
        try:
            self._begin_step(check_verdict=False)  # type: ignore[attr-defined]
            yield
            self._check_step_end()  # type: ignore[attr-defined]
        except RecoveryStopped:
            self._in_step = False
            raise
        except Exception as exc:  # noqa: BLE001 -- classified there, re-raised if not ours
            self._in_step = False
            if self._failure_cause_peek(exc) and self._applied:  # type: ignore[attr-defined]
                self._count_applied_step()  # type: ignore[attr-defined]  # update ran before
            elif not self._applied:
                self._reset_grad_scalers()  # type: ignore[attr-defined]
            self._recover_until_done(exc)  # type: ignore[attr-defined]
            return
        self._in_step = False
        self._end_step()  # type: ignore[attr-defined]

    def micro_batches(self) -> Iterator[MicroBatch]:
        """This rank's micro-batches of the current step under the current batch plan (the
        policy's: with ``keep_batch`` more of them after a rank is lost). Gradients are
        accumulated locally (``no_sync``) on all but the last, whose backward all-reduces."""
        mbs = self.plan.micro_batches(self.rank)
        for i, mb in enumerate(mbs):
            if i < len(mbs) - 1:
                with self.no_sync():  # type: ignore[attr-defined]
                    yield mb
            else:
                yield mb


__all__ = ["StepLoop"]
