"""In-process recovery: the survivors of a rank failure keep training without a restart.

The user gives a model, an optimizer and a loss function; :meth:`Recovery.run` runs the steps::

    with Recovery(store, rank, world, model, opt, global_batch=64, micro_batch=16) as rec:
        rec.run(lambda step, mb: loss_fn(rec.model(x(step)[mb.slice]), y(step)[mb.slice]),
                start=0, end=1000)

A torchrun-style script that already called ``init_process_group`` (and wrapped its model in
DDP) uses ``Recovery.adopt(model, opt, global_batch=..., micro_batch=...)``: the default group,
its store and the model are taken over (resilient.recovery.environment); launch it with
``resilient run`` (resilient.recovery.agent), whose agent keeps the survivors alive. The loop can
also stay the user's: ``for step in rec.steps(a, b): with rec.attempt(): ...``
(resilient.recovery.loop).

On a failure (a collective error, the detector's verdict, or a collective past its timeout):

1. **abort**: the gradient all-reduce is polled, never waited on (gloo: a DDP comm hook; NCCL:
   a step pre-hook on the optimizers that polls a CUDA event), so the training thread stops
   using the failed group at once. gloo's abort cannot unblock a collective; NCCL groups are
   revoked from the detector's thread when the verdict comes during a step (aborted where NCCL
   cannot revoke), and aborted in the background by the rebuild;
2. **agree**: wait for the detector's decided generation that removes a member; every survivor
   acts on the same record (compare-and-set on the store), so they agree on the membership;
3. **policy**: fewer than ``min_world`` survivors -> :class:`RecoveryStopped`; otherwise the new
   batch plan and learning-rate factor (``resilient.recovery.policy``);
4. **rebuild**: shrink the group (NCCL, where torch can) or abort it and create generation
   ``1000 * g``'s group under a ``gen<..>/`` store prefix (``resilient.comm``); a second failure
   during the rebuild waits for the next generation and tries again;
5. **restore**: the survivors all-gather their completed step. Equal (the usual case: the step
   whose all-reduce failed never reached ``optimizer.step``) -> keep the in-memory state and redo
   the step. Different -> load from storage (``mismatch_source="storage"`` with a Checkpointer)
   or broadcast the state of the most advanced survivor;
6. re-wrap DDP on the new group and continue; the first completed gradient all-reduce ends the
   recovery. Every phase is an event in :attr:`Recovery.timeline`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient import _follow_store_setting
from resilient.checkpoint.broadcast import broadcast_state
from resilient.checkpoint.ranks import abandon_when
from resilient.comm.process_group import (
    abort_process_group,
    forget_device_meshes,
    gloo_lazy_init,
    join_process_group,
    release_retired_groups,
    retire_groups,
    shrink_abort_flag,
    supports_shrink,
    wait_for_revoke,
)
from resilient.errors import CollectiveError
from resilient.recovery import device as device_state
from resilient.recovery import report, sharded
from resilient.recovery.config import RecoveryConfig
from resilient.recovery.decisions import (
    PeerFailure,
    RecoveryStopped,
    agree,
    classify,
    member_failed,
    poll_collective,
)
from resilient.recovery.environment import (
    JOIN_ENV,
    may_be_served_by_a_rank,
    warn_about_launcher,
)
from resilient.recovery.gate import GateAbandoned, meet
from resilient.recovery.join import (
    JOIN_BASE,
    admit_in_recovery,
    join_as_spare,
    mark_finished,
    maybe_admit,
)
from resilient.recovery.loop import StepLoop
from resilient.recovery.lr import scale_learning_rates
from resilient.recovery.policy import EXIT_EVICTED, BatchPlan, Decision, MicroBatch, decide
from resilient.recovery.samplers import Samplers
from resilient.recovery.timeline import Timeline

log = logging.getLogger("resilient.recovery")
# After a revoke, the NCCL groups are aborted this much later unless the rebuild began it.
_ABORT_AFTER_REVOKE_S = 0.25
_follow_store_setting()  # RESILIENT_STORE=etcd:// (torch is imported now)

LossFn = Callable[[int, MicroBatch], torch.Tensor]
FAULT_POINTS = ("step_start", "before_rebuild", "before_restore", "after_recovery")



class Recovery(StepLoop):
    """Runs a DDP training loop that survives rank failures (see the module docstring).

    Args:
        store: the job's store (e.g. a TCPStore hosted by the launcher; must outlive any rank).
        rank, world_size: this process's rank in the initial job, and the job's size.
        model: the module (not yet wrapped); on GPU, already on its device.
        optimizer: its optimizer (its learning rates are the base of the ``scale_lr`` policy).
        global_batch, micro_batch: samples per step in the initial job, and the most one
            forward pass takes (the batch plan is derived from these; ``rec.micro_batches()``
            gives each rank its share). Leave both out when the loop draws one batch per rank
            and step from its own DataLoader: a step is then one batch per rank, the global
            batch shrinks with the world, and the ``keep_batch`` policy (which needs the loop
            over ``rec.micro_batches()``) becomes ``none`` (``scale_lr`` still scales the
            learning rate).
        backend: "gloo" or "nccl".
        config: settings (default ``RecoveryConfig.from_env()``).
        checkpointer: optional. A ``resilient.CheckpointManager`` (the usual one, collective):
            every rank saves its part at the manager's ``every``, and after a rebuild the
            manager moves onto the survivors' group (saves that needed the lost rank are
            abandoned; committed checkpoints stay). Or a ``Checkpointer(root,
            distributed=False)``: rank 0 saves every ``checkpoint_every`` steps. Survivors whose
            steps differ load the newest checkpoint (``mismatch_source="storage"``).
        extra_state: a dict of further state (e.g. a scheduler) broadcast/saved with the model.
        detector: a started or unstarted ``FailureDetector`` (default: one is created with
            ``detector_options``). job: the detector's job name.
        ddp_kwargs: passed to DistributedDataParallel.
        samplers: the ResumableSampler(DistributedSampler(...)) objects of the user's
            DataLoaders: a failed step rewinds them to where it began and a world change
            re-splits the rest of the epoch over the new group (resilient.recovery.samplers).
        data_parallel: ``(world, rank) -> (data-parallel ranks, this rank's data-parallel
            rank)`` of the current group, for the samplers' split (default: every rank reads
            its own data). With tensor parallelism, the ranks of a tensor-parallel group read
            the same batches: e.g. ``(world // tp, rank // tp)`` while the mesh has a ``tp``
            dimension (called after every world change, when ``build()`` made the new one).
        build: for a sharded model (FSDP2 ``fully_shard``): a function that creates the model
            and shards it over the current default group, as the script did at start. Its
            shards are then replicated to peers' host memory after every step, and after a
            failure the model is built again on the new group and filled from memory
            (resilient.recovery.sharded).
    """

    def __init__(self, store: Any, rank: int, world_size: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, *, global_batch: int | None = None,
                 micro_batch: int | None = None,
                 backend: str = "gloo", config: RecoveryConfig | None = None,
                 checkpointer: Any = None, checkpoint_every: int = 0,
                 extra_state: dict | None = None, detector: Any = None,
                 detector_options: dict | None = None, job: str | None = None,
                 ddp_kwargs: dict | None = None, samplers: list | None = None,
                 data_parallel: Callable[[int, int], tuple[int, int]] | None = None,
                 build: Callable[[], torch.nn.Module] | None = None) -> None:
        self.config = config or RecoveryConfig.from_env()
        self.config.validate()
        self.store = store
        self.initial_rank = rank
        self.initial_world = world_size
        self.rank, self.world_size = rank, world_size
        self.members = list(range(world_size))  # initial ranks of the current group, in order
        self.module = model
        self.model: Any = None
        self.optimizer = optimizer
        self.backend = backend
        if (global_batch is None) != (micro_batch is None):
            raise ValueError("give both global_batch and micro_batch, or neither (one batch "
                             "per rank and step from the loop's own DataLoader)")
        self.loader_batches = global_batch is None  # a step is one loader batch per rank
        if global_batch is None:
            global_batch, micro_batch = world_size, 1
            if self.config.policy == "keep_batch":
                log.info("resilient recovery: no global_batch given, so a step is one batch "
                         "per rank; after a rank is lost the global batch shrinks (policy "
                         "'none'). keep_batch needs global_batch, micro_batch and the loop "
                         "over rec.micro_batches()")
                self.config.policy = "none"
        self.global_batch, self.micro_batch = global_batch, micro_batch
        from resilient.checkpoint.manager import CheckpointManager

        self.manager = checkpointer if isinstance(checkpointer, CheckpointManager) else None
        if self.manager is None and checkpointer is not None and getattr(
                checkpointer, "world_size", 1) != 1:
            raise ValueError("a distributed Checkpointer is bound to the group that a failure "
                             "replaces: pass a CheckpointManager (it follows the group) or "
                             "Checkpointer(root, distributed=False) (rank 0 saves)")
        self.checkpointer = None if self.manager is not None else checkpointer
        self.checkpoint_every = checkpoint_every
        self.extra_state = extra_state if extra_state is not None else {}
        if self.manager is not None:
            self._share_manager_state(model, optimizer)
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.samplers = Samplers(samplers)
        self.data_parallel = data_parallel or (lambda world, rank: (world, rank))
        self._check_sampler_split()
        self.build = build  #: the sharded model's factory (None: DDP)
        self.replicas: Any = None  #: the sharded model's PeerReplicas
        if build is not None:
            sharded.check(self)
        report.install()  # torch's log format on stderr, RESILIENT_LOG_LEVEL (report.py)
        self.timeline = Timeline(rank)
        self._reported = 0  # timeline events up to here are in a recovery's summary line
        #: how a rank the others removed leaves (tests replace it): os._exit, no teardown
        self.leave: Callable[[int], None] = device_state.leave
        self._leaving = threading.Lock()
        self.fault_hooks: dict[str, list[Callable[[Recovery], None]]] = {
            p: [] for p in FAULT_POINTS}
        self.step = 0  #: completed steps (the next step to run)
        self.generation = 0  #: the detector generation of the current group
        self.recoveries = 0
        self.plan: BatchPlan = self._decide(world_size).plan  # type: ignore[assignment]
        self.lr_factor = 1.0  #: the policy's learning-rate factor now applied (scale_lr)
        self._warned_lr = False
        self._device = self._comm_device()
        self._group: Any = None
        self._verdict = threading.Event()
        self._evicted = threading.Event()
        self._pending_cause: str | None = None
        self._in_step = False  # a step's collectives may be in flight (verdict: abort NCCL)
        self._applied = False  # this step's optimizer.step ran (a later failure keeps it)
        self._gated = False  # the optimizer step pre-hook that gates on the all-reduce is on
        self._gate_handles: list[Any] = []
        # The clock and sleep of the poll loops (decisions.py decides; tests may replace these).
        self.clock: Callable[[], float] = time.monotonic
        self.sleep: Callable[[float], None] = time.sleep
        self._min_generation = 1
        self._awaiting_first = False
        self.job = job or "default"
        self.admitted = 0  #: joiners admitted so far (the same on every member)
        self.join_epoch = 0  #: admissions so far (part of the group generation)
        self._detector_options = detector_options
        self.detector = detector
        self._polled_detector = False  # a joiner's detector has no callbacks: poll it
        self._adopted_group: Any = None  # the user's default group (Recovery.adopt)
        self._detector_host: str | None = None
        self._join_on_start = False  # a replacement started by `resilient run` (adopt)
        self.joined = False  #: this process joined a running job (start(join=True))
        self.started = False  #: start() ran (close() ends it)

    @classmethod
    def adopt(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              **kwargs: Any) -> Recovery:
        """A Recovery for a job that already called ``torch.distributed.init_process_group``
        (every torchrun script does): it takes the default group as its first group, the store
        behind it (the launcher's, see resilient.recovery.environment), the rank and the world
        size, and the model, unwrapped if the user already wrapped it in DDP (Recovery wraps
        it again over its own groups: the loss function uses ``rec.model``). A rebuild after a
        failure replaces the default group, as without adoption. ``kwargs`` are the
        constructor's (``global_batch`` and ``micro_batch``: see there; ``backend`` defaults
        to the group's).

        Raises:
            RuntimeError: no default process group.
        """
        from resilient.recovery import environment

        store = environment.default_group_store()
        wanted = os.environ.get(environment.STORE_ENV, "")
        if wanted.startswith(("etcd://", "etcds://")) and not hasattr(store, "endpoints"):
            log.warning("resilient: RESILIENT_STORE names an etcd cluster, but the default "
                        "process group's store is a %s: import resilient before "
                        "init_process_group() so that env:// rendezvouses on etcd",
                        type(store).__name__)
        module = model.module if isinstance(model, DDP) else model
        if "backend" not in kwargs:
            name = str(dist.get_backend())
            device = next(module.parameters()).device.type
            if device == "meta" and "gloo" in name and "nccl" in name:
                raise ValueError(f"the default group is {name!r} and the model is on the meta "
                                 "device (a joiner's): pass backend='nccl' or 'gloo' to "
                                 "Recovery.adopt, as the job's members use")
            # a joiner's first model may be on the meta device (environment.joining)
            on_gpu = device == "cuda" or (device == "meta" and torch.cuda.is_available())
            kwargs["backend"] = "nccl" if "nccl" in name and on_gpu else "gloo"
        rec = cls(environment.job_store(store), dist.get_rank(), dist.get_world_size(), module,
                  optimizer, **kwargs)
        rec._adopted_group = dist.group.WORLD
        if os.environ.get(environment.JOIN_ENV) == "1":
            # `resilient run` replaces a lost rank: this process's one-rank group only kept the
            # script's init_process_group from waiting for the job's old group; it joins.
            rec._join_on_start = True
            rec.initial_world = int(os.environ.get("RESILIENT_JOIN_WORLD", rec.initial_world))
            if rec.loader_batches:  # one batch per rank of the job it joins
                rec.global_batch = rec.initial_world
        host, port = getattr(store, "host", None), getattr(store, "port", 0)
        if not host and getattr(store, "endpoints", None):  # EtcdStore: its first member
            host, port = store.endpoints[0]
        if host:
            from resilient.detect import local_address_towards

            rec._detector_host = local_address_towards(host, port)
        return rec

    # ---- lifecycle ----
    def start(self, join: bool = False) -> Recovery:
        """Starts the detector and creates the first process group and DDP wrapper.

        With ``join=True`` this process is a spare or restarted rank: it waits (up to
        ``join_timeout_s``) until the running job admits it, then receives the state from a
        live peer (see resilient.recovery.join); ``self.step`` is then the job's step.
        """
        if self.started:
            raise RuntimeError("this Recovery is already started")
        self._check_meta_model(joins=join or self._join_on_start)
        self.started = True
        device_state.load_probe(self._device)  # before any kernel can be stuck on a peer
        # A script need not close it: at exit, the replication threads must end before the
        # interpreter finalizes (one returning from gloo then aborts the process).
        atexit.register(self._close_at_exit)
        if join or self._join_on_start:
            warn_about_launcher()
            self.joined = join_as_spare(self, self.config.join_timeout_s)
            os.environ.pop(JOIN_ENV, None)  # (cleared at admission; here also when too late)
            self._polled_detector = True
            self.timeline.add("started", world_size=self.world_size, joined=self.joined)
            if not self.joined:
                log.warning("resilient recovery: the job finished (step %d) before this rank "
                            "was admitted; nothing to do", self.step)
            return self
        warn_about_launcher(adopted=self._adopted_group is not None
                            and may_be_served_by_a_rank(self.store))
        if self.detector is None:
            from resilient.detect import FailureDetector

            self.detector = FailureDetector(
                self.store, self.initial_rank, self.initial_world, job=self.job,
                host=self._detector_host, options=self._detector_options)
        if getattr(self.detector, "_agent", None) is None:
            # A recovery (e.g. a rendezvous waiting for a slow rank) is not a training hang.
            self.detector.set_watchdog_option("recovery_section_limit_s",
                                              3 * self.config.group_timeout_s)
        self.detector.on_failure = self._on_failure
        self.detector.on_evicted = self._on_evicted
        if getattr(self.detector, "_agent", None) is None:
            self.detector.start()
        if self._adopted_group is not None:
            self._group = self._adopted_group  # the user's init_process_group made it
        else:
            self._group = join_process_group(
                self.store, generation=0, rank=self.rank, world_size=self.world_size,
                backend=self.backend, timeout=timedelta(seconds=self.config.group_timeout_s),
                device_id=self._device if self._device.type == "cuda" else None)
        self._wrap(init_sync=True)
        self._gate_optimizer()
        if self.build is not None:
            sharded.poll_collectives(self, self.module)
            sharded.start_replicas(self)
        self.timeline.add("started", world_size=self.world_size)
        return self

    def _check_sampler_split(self) -> None:
        """A sampler split otherwise than ``data_parallel`` says would be re-split the other
        way at the first world change: tensor-parallel peers would silently read different
        batches from then on."""
        want = tuple(self.data_parallel(self.world_size, self.rank))
        for s in self.samplers.items:
            d = s.distributed
            if (d.num_replicas, d.rank) != want:
                raise ValueError(
                    f"a sampler is split over {d.num_replicas} ranks (this one reads as rank "
                    f"{d.rank}), but data_parallel({self.world_size}, {self.rank}) gives "
                    f"{want}: pass Recovery(data_parallel=...) returning the sampler's split "
                    "(with tensor parallelism, the ranks that read the same batches), or split "
                    "the DistributedSampler over every rank")

    def _check_meta_model(self, joins: bool) -> None:
        """A model on the meta device holds no state: only a sharded model's joiner may pass one
        (its model is built again and filled from the members' snapshots when it joins)."""
        if not any(p.device.type == "meta" for p in self.module.parameters()):
            return
        if not joins:
            raise ValueError("the model's parameters are on the meta device: only a process "
                             "that joins a running job (a spare or replacement, "
                             "resilient.joining()) may start with such a model; build it on "
                             "its device")
        if self.build is None:
            raise ValueError("a joiner's model on the meta device needs Recovery(build=...): "
                             "without build (DDP) the members' state is copied into the "
                             "model's own tensors")

    def close(self, *, replica_timeout_s: float = 30.0) -> None:
        """Stops the detector and the peer replication (bounded by ``replica_timeout_s``) and
        waits for checkpoint saves in flight. Failed groups stay referenced: their destructors
        could block until the group timeout (see comm docs). Called at exit if the script did
        not."""
        atexit.unregister(self._close_at_exit)
        self._close(replica_timeout_s, at_exit=False)

    def _close_at_exit(self) -> None:
        """close() for a script that did not call it. The replication threads get 5 s for their
        buddies' stop messages (30 s while a snapshot is still being sent), none when the
        script ends on an uncaught exception (its sources still train: their peers should see
        this rank leave now). The checkpointer's own exit handler waits for its saves."""
        if not self.started:
            return
        failed = getattr(sys, "last_value", None) is not None
        sending = self.replicas is not None and self.replicas.sending
        try:
            self._close(0.0 if failed else 30.0 if sending else 5.0, at_exit=True)
        except BaseException as exc:  # noqa: BLE001 -- the process is exiting anyway
            log.warning("resilient recovery: closing at exit failed (%s)", exc)

    def _close(self, replica_timeout_s: float, at_exit: bool) -> None:
        self.started = False
        if self.replicas is not None:
            self.replicas.close(replica_timeout_s)
        if self.build is not None:
            sharded.unpoll_hsdp_all_reduce(self)
        if self._gated:  # the optimizers outlive this Recovery
            for handle in self._gate_handles:
                handle.remove()
            self._gate_handles, self._gated = [], False
        if self.detector is not None:
            self.detector.stop()
        from resilient.comm.process_group import abort_revoked, wait_for_aborts

        abort_revoked()  # a revoked communicator is aborted, never finalized
        if not wait_for_aborts(10.0):  # a process that exits amid an NCCL abort may crash
            log.warning("resilient recovery: an NCCL abort is still running after 10 s")
        if self.checkpointer is not None and not at_exit:
            with contextlib.suppress(Exception):
                self.checkpointer.wait(self.config.group_timeout_s)

    def __enter__(self) -> Recovery:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the loop ----
    def run(self, loss_fn: LossFn, start: int | None, end: int) -> int:
        """Runs steps ``start`` .. ``end - 1``, recovering from failures; returns the number of
        completed steps (``end``).

        ``loss_fn(step, mb)`` computes the mean loss of micro-batch ``mb`` of ``step`` through
        ``self.model`` (samples ``mb.slice`` of the step's global batch); this calls backward,
        the gradient all-reduce and ``optimizer.step``. ``start=None`` continues from
        ``self.step``; a rank that joined a running job always continues from the job's step.

        Raises:
            RecoveryStopped: too few ranks, this rank was evicted, or too many recoveries.
        """
        if start is not None and not (self.joined or self._join_on_start):
            self.step = start  # a joiner continues from the job's step
        self._gate_optimizer()
        while self.step < end:
            try:
                self._begin_step()
                self._in_step = True
                self._train_step(loss_fn, self.step)
                self._in_step = False
                self._end_step()
            except RecoveryStopped:
                raise
            except Exception as exc:  # noqa: BLE001 -- classified below, re-raised if not ours
                self._in_step = False
                self._recover_until_done(exc)
        self._finished()
        return self.step

    def _begin_step(self, check_verdict: bool = True) -> None:
        """A step starts. ``check_verdict=False`` (``attempt``, which cannot skip its block once
        entered): a member lost between steps is found by the step's first collective, which
        raises inside the block, where the step can be redone."""
        self._applied = False  # this step's update has not run yet (the optimizer gate)
        self.samplers.begin(self.step)
        self._run_hooks("step_start")
        if self._awaiting_first:  # the timeline: from here to first_collective is the step's
            self.timeline.add("first_step_began", step=self.step)  # forward and backward
        if self._evicted.is_set():
            self._leave_evicted()
            raise RecoveryStopped(self._stop("this rank was removed from the job"))
        if self._verdict.is_set() and self._members_failed():
            if check_verdict:
                raise PeerFailure("verdict")
            if self.backend == "nccl":  # the verdict came between steps: nothing aborted the
                self._abort_in_flight()  # group, and this step's kernels would wait on it

    def _end_step(self) -> None:
        self.step += 1
        self.detector.step(self.step)
        release_retired_groups(expired_only=True)  # those of past recoveries, once timed out
        try:  # collectives of their own (the replicas' interval, the manager's save, an
            # admission): a peer may die
            sharded.replicate(self)
            self._maybe_checkpoint()
            maybe_admit(self)
        except RecoveryStopped:
            raise
        except Exception as exc:  # noqa: BLE001 -- classified there, re-raised if not ours
            if isinstance(exc, CollectiveError) and self._pending_cause is None:
                self._pending_cause = "collective_error"  # a save that a peer never entered
            self._recover_until_done(exc)  # the step is done: recover, then the next one

    def _finished(self) -> None:
        if self.config.join_check_every > 0:
            mark_finished(self)

    def _recover_until_done(self, exc: BaseException) -> None:
        """Recovers from ``exc``; a failure during the recovery starts the next one."""
        while True:
            cause = self._failure_cause(exc)
            self._leave_if_device_lost(exc, cause)
            if cause is None:
                raise exc
            try:
                with self.detector.section("recovery"):  # not a hang while we rebuild
                    self._recover(cause, exc)
                return
            except RecoveryStopped:
                raise
            except Exception as again:  # noqa: BLE001 -- classified on the next iteration
                exc = again

    def _leave_if_device_lost(self, exc: BaseException, cause: str | None) -> None:
        """Ends this process when the step's failure left its device unusable (a sticky CUDA
        error): it cannot take part in a recovery (resilient.recovery.device)."""
        device = self._compute_device()
        why = device_state.lost(exc, device, collective_error=cause is not None)
        if why is None:
            return
        message = device_state.describe(self.initial_rank, device, why)
        self.timeline.add("device_lost", step=self.step, error=why)
        log.error("resilient recovery: %s", message, exc_info=exc)
        with contextlib.suppress(Exception):  # the peers' verdict follows from the silence
            self.detector.stop()
        device_state.leave()

    def _compute_device(self) -> torch.device:
        """The device the model computes on: the collectives' one, or (a gloo job training on a
        GPU) the current CUDA device once CUDA is in use."""
        if self._device.type == "cpu" and torch.cuda.is_available() and \
                torch.cuda.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return self._device

    def _train_step(self, loss_fn: LossFn, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        mbs = self.plan.micro_batches(self.rank)
        for i, mb in enumerate(mbs):
            sync = i == len(mbs) - 1
            with contextlib.nullcontext() if sync else self.no_sync():
                loss = loss_fn(step, mb)
                (loss * mb.loss_scale).backward()
        self.optimizer.step()  # gated: _before_optimizer_step

    # ---- the optimizer gate ----
    def _gate_optimizer(self) -> None:
        """Registers :meth:`_before_optimizer_step` on the optimizer and on every further
        optimizer of the state (``extra_state``, the CheckpointManager's): none may update from
        a half-reduced gradient. Once; :meth:`close` removes them."""
        if self._gated:
            return
        if not isinstance(self.optimizer, torch.optim.Optimizer) and self.backend == "nccl":
            raise TypeError(
                f"Recovery with NCCL needs a torch.optim.Optimizer, not "
                f"{type(self.optimizer).__name__}: a step pre-hook holds the step until the "
                "gradient all-reduce completed")
        optimizers = [self.optimizer, *self.extra_state.values()]
        seen: set[int] = set()
        for opt in optimizers:
            if isinstance(opt, torch.optim.Optimizer) and id(opt) not in seen:
                seen.add(id(opt))
                self._gate_handles.append(
                    opt.register_step_pre_hook(self._before_optimizer_step))
        self._gated = True

    def _before_optimizer_step(self, *_: Any) -> None:
        """Runs before every optimizer step inside a protected step. On GPU the gradient
        all-reduce is asynchronous on NCCL's stream: the step may only be queued behind it once
        it completed, so this polls a CUDA event recorded now while watching the verdict and
        the collective timeout (PeerFailure: the step never changed the state). Then the step
        counts as applied on this rank, so a failure later in the same step is not redone; a
        further optimizer of the same step then steps from the same, complete gradients."""
        if not self._in_step or self._applied:
            return
        if self._device.type == "cuda":
            self._poll(self._device_fence(), lambda: None)
            if self._verdict.is_set() and self._members_failed():
                # The event may have completed because the group was aborted (_on_failure):
                # the gradients are not the peers' sum.
                self._pending_cause = "verdict"
                raise PeerFailure("verdict", "a member failed before the gradients were reduced")
            self._first_collective_done()
        self._applied = True

    def _check_step_end(self) -> None:
        """A protected step ends: on NCCL, a verdict during a step whose update never ran (the
        GradScaler skipped it on the aborted group's garbage gradients, or no optimizer stepped)
        fails the step, so it is redone rather than counted."""
        if (self.backend == "nccl" and not self._applied and self._verdict.is_set()
                and self._members_failed()):
            self._pending_cause = "verdict"
            raise PeerFailure("verdict", "a member failed during the step")

    def _reset_grad_scalers(self) -> None:
        """A failed step may have left a GradScaler of the state (extra state, or the
        CheckpointManager's) between ``unscale_`` and ``update``; its redo must start clean
        (``unscale_`` would raise "already been called", ``step`` would not unscale)."""
        from torch.amp.grad_scaler import GradScaler, _refresh_per_optimizer_state

        for obj in self.extra_state.values():
            if isinstance(obj, GradScaler):
                obj._per_optimizer_states = collections.defaultdict(
                    _refresh_per_optimizer_state)

    def _device_fence(self) -> Callable[[], bool]:
        """A test of whether the work queued so far on the current CUDA stream completed."""
        ev = torch.cuda.Event()
        ev.record()
        return ev.query

    def _count_applied_step(self) -> None:
        """The step's optimizer.step ran before a later part of it failed: it is complete."""
        self.step += 1
        self.detector.step(self.step)

    # ---- abortable collectives ----
    def _poll(self, done: Callable[[], bool], finish: Callable[[], Any]) -> Any:
        """Polls ``done`` until true, then returns ``finish()``; raises PeerFailure on a verdict
        against a member, the collective timeout, or an error from ``finish``."""
        deadline = self.clock() + self.config.collective_timeout_s
        while not done():
            cause = poll_collective(
                self.clock(), deadline, evicted=self._evicted.is_set(),
                member_failed=(self._verdict.is_set() or self._polled_detector)
                and self._members_failed())
            if cause is not None:
                self._pending_cause = cause
                detail = f"collective ran {self.config.collective_timeout_s}s" if (
                    cause == "timeout") else ""
                raise PeerFailure(cause, detail)
            self.sleep(self.config.poll_interval_s)
        try:
            return finish()
        except Exception as exc:
            self._pending_cause = "collective_error"
            raise PeerFailure("collective_error", str(exc).splitlines()[0][:200]) from exc

    def wait(self, work: Any) -> None:
        """Waits for the work of a collective of the loop's own, issued with ``async_op=True``
        inside a step, polling it while watching the verdict: a peer lost meanwhile raises
        PeerFailure (recovered from by ``attempt``) instead of blocking until the group's
        timeout, which gloo cannot abort."""
        self._wait_work(work)

    def _wait_work(self, work: Any) -> None:
        self._poll(work.is_completed, work.wait)

    def _allreduce_hook(self, _state: Any, bucket: Any) -> torch.futures.Future:
        """DDP comm hook (gloo): an all-reduce that the training thread polls, so a verdict
        stops it even when gloo would block until its timeout."""
        buf = bucket.buffer()
        self._wait_work(dist.all_reduce(buf, group=self._group, async_op=True))
        buf.div_(self.world_size)
        self._first_collective_done()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def _first_collective_done(self) -> None:
        if self._awaiting_first:
            self._awaiting_first = False
            self.timeline.add("first_collective", step=self.step, generation=self.generation,
                              world_size=self.world_size)
            events = self.timeline.events
            window, self._reported = events[self._reported:], len(events)
            line = report.summary(window, self.config.policy, self.loader_batches)
            if line is not None and self.rank == 0:  # one line per recovery, on rank 0
                log.warning("[rank%d]: %s", self.initial_rank, line)

    # ---- detector callbacks (dispatcher thread) ----
    def _on_failure(self, ranks: list, generation: int) -> None:
        reasons = getattr(self.detector, "removed_reasons", {}) or {}
        self.timeline.add("verdict", removed=list(ranks), generation=generation,
                          reasons={r: reasons[r] for r in ranks if r in reasons})
        self._verdict.set()
        if not set(ranks) & self._watched():
            return
        if self.manager is not None:
            self.manager.abort(f"rank(s) {sorted(ranks)} failed")  # a save waiting for them
        if self.backend == "nccl" and self._in_step:
            self._abort_in_flight()

    def _abort_in_flight(self) -> None:
        """Revokes the current NCCL groups from the detector's thread (aborts them where NCCL
        cannot revoke): kernels waiting for the dead peer end, so a training thread blocked in
        a CUDA sync of the step (``loss.item()`` after backward, GradScaler's inf check)
        returns; the step is then failed by the optimizer gate or by its next collective, and
        the rebuild aborts and replaces the groups."""
        group = self._group
        if group is None:
            return
        self.timeline.add("aborted", generation=self.generation)
        t0 = time.monotonic()
        # with it every other NCCL group (a device mesh's dimensions: HSDP's replicate and
        # shard groups, tensor parallel's), where the training thread may be waiting too
        from resilient.comm.process_group import (
            abort_groups,
            revoke_groups,
            start_aborts,
            with_nccl_groups,
        )

        groups = with_nccl_groups(group)
        try:
            if not self.config.revoke_nccl:
                abort_groups(groups)
            elif revoked := revoke_groups(groups, self._device):
                # Their operations fail at once. The abort waits for the rebuild, on the
                # training thread: begun now, it would hold the backend's lock for up to
                # 0.5 s, and FSDP2's next collective would wait for that lock first.
                self.timeline.add("revoked", communicators=revoked)
                # A thread blocked where no revoke reaches (a communicator other than the
                # group's collective one, a group whose revoke failed) reaches no rebuild:
                # abort them all a little later, unless the rebuild already began it.
                timer = threading.Timer(_ABORT_AFTER_REVOKE_S, start_aborts, args=(groups,),
                                        kwargs={"on_done": self._abort_finished})
                timer.daemon = True
                timer.start()
            else:  # no revoke in this NCCL: the abort ends them, the rebuild does not wait
                start_aborts(groups, on_done=self._abort_finished)
        except Exception as exc:  # noqa: BLE001 -- the rebuild aborts and destroys it again
            log.warning("resilient recovery: aborting the NCCL group failed (%s)", exc)
        self.timeline.add("abort_returned", seconds=time.monotonic() - t0)

    def _abort_finished(self, seconds: float) -> None:
        self.timeline.add("abort_finished", seconds=round(seconds, 4))

    def _on_evicted(self, generation: int) -> None:
        self.timeline.add("evicted", generation=generation)
        self._evicted.set()
        self._leave_evicted(generation)

    def _leave_evicted(self, generation: int | None = None) -> None:
        """This rank was removed from the job by the other ranks (the detector's generation
        `generation` no longer holds it; a woken frozen rank learns it as it runs again): it
        has no part in the job any more and the others gave its saves up. It says so and leaves
        at once (from whichever thread learned it first) with EXIT_EVICTED (76), without
        Python's teardown: a checkpointer's exit handler would wait up to a minute for saves
        that can never commit; ``resilient run`` counts the exit as a removal, neither a
        failure nor a finish. Returns only where a test replaced ``leave``."""
        if not self._leaving.acquire(blocking=False):
            return
        gen = generation if generation is not None else self.detector.generation[0]
        message = (f"[rank{self.initial_rank}]: resilient: this rank was removed from the job "
                   f"by the other ranks at step {self.step} (detector generation {gen}): it "
                   "did not answer their heartbeats in time (frozen, stopped or cut off) or "
                   "its training stalled past its hang limit. The job goes on without it; "
                   f"exiting with {EXIT_EVICTED} (resilient.recovery.EXIT_EVICTED)")
        self.timeline.add("stopped", reason="evicted", step=self.step, generation=gen)
        log.error("%s", message)
        self.leave(EXIT_EVICTED)

    def _watched(self) -> set[int]:
        """Members the detector watches (joiners are outside its fixed world)."""
        return {m for m in self.members if m < JOIN_BASE}

    def _newer_verdict(self) -> str | None:
        """Why the current group is already lost (a generation newer than it removed a member,
        or this rank was evicted), else None: what ends a wait of the rebuild's."""
        if self._evicted.is_set():
            return "this rank was removed from the job"
        if self._members_failed():
            gen, live = self.detector.generation
            gone = sorted(self._watched() - set(live))
            return f"generation {gen} removed rank(s) {gone}"
        return None

    def _members_failed(self) -> bool:
        gen, live = self.detector.generation
        return member_failed(gen, live, min_generation=self._min_generation,
                             watched=self._watched())

    def _failure_cause_peek(self, exc: BaseException) -> bool:
        """Whether `exc` is a peer failure (without consuming the pending cause)."""
        return classify(exc, self._pending_cause) is not None

    def _failure_cause(self, exc: BaseException) -> str | None:
        pending, self._pending_cause = self._pending_cause, None
        return classify(exc, pending)

    # ---- recovery ----
    def _recover(self, cause: str, exc: BaseException) -> None:
        self.timeline.add("failure_observed", cause=cause, step=self.step,
                          error=str(exc).splitlines()[0][:200] if str(exc) else "")
        if cause == "evicted":
            self._leave_evicted()
            raise RecoveryStopped(self._stop("this rank was removed from the job"))
        self.recoveries += 1
        if self.recoveries > self.config.max_recoveries:
            raise RecoveryStopped(self._stop(f"more than {self.config.max_recoveries} recoveries"))
        while True:
            gen, live = self._agree()
            survivors = [m for m in self.members if m in live or m >= JOIN_BASE]
            if self.initial_rank not in survivors:
                self._leave_evicted(gen)
                raise RecoveryStopped(self._stop("this rank was removed from the job"))
            decision = self._decide(len(survivors))
            if decision.stop:
                raise RecoveryStopped(self._stop(decision.message))
            self._run_hooks("before_rebuild")
            try:
                self._rebuild(gen, survivors)
                break
            except RecoveryStopped:
                raise
            except Exception as err:  # noqa: BLE001 -- a second failure: next generation
                self.timeline.add("rebuild_failed", generation=gen, error=str(err)[:200])
                if isinstance(err, GateAbandoned):
                    log.info("generation %d left before its group was built (%s)", gen, err)
                else:
                    log.warning("rebuild of generation %d failed (%s); waiting for the next",
                                gen, err)
                self._min_generation = gen + 1
        self._run_hooks("before_restore")
        try:
            self.follow_group(lost_rank=True)
            self._restore()
        except (PeerFailure, RecoveryStopped):
            raise
        except Exception as err:  # the new group failed while state moved: the next recovery
            if not isinstance(err, CollectiveError) and classify(err) is None:
                raise  # not a peer's failure (a root in use, a damaged checkpoint): as it is,
                # rather than a wait for a verdict that no peer's loss will bring
            raise PeerFailure("collective_error", f"restoring state failed: {err}") from err
        if self.world_size != len(survivors):  # hot spares joined: the plan for that world
            decision = self._decide(self.world_size)
        self._apply(decision)
        self._awaiting_first = True
        self._run_hooks("after_recovery")

    def _agree(self) -> tuple[int, list[int]]:
        """Waits for the detector's decided generation that removes a current member."""
        self._stop_if_store_gone()
        deadline = self.clock() + self.config.agree_timeout_s
        while True:
            gen, live = self.detector.generation
            a = agree(self.clock(), deadline, gen, list(live), min_generation=self._min_generation,
                      watched=self._watched(), evicted=self._evicted.is_set())
            if a.action == "agreed":
                self._verdict.clear()
                self.timeline.add("agreed", generation=a.generation, removed=a.removed,
                                  members=a.live)
                return a.generation, a.live
            if a.action == "evicted":
                self._leave_evicted(gen)
                raise RecoveryStopped(self._stop("this rank was removed from the job"))
            if a.action == "timeout":
                self._stop_if_store_gone()
                raise RecoveryStopped(self._stop(
                    f"a collective failed but the detector removed no rank within "
                    f"{self.config.agree_timeout_s}s"))
            self.sleep(0.001)

    def _stop_if_store_gone(self) -> None:
        """RecoveryStopped with the reason when the job's store does not answer: agreeing
        goes through it, so waiting for a verdict would only end in a timeout."""
        unreachable = self._store_unreachable()
        if unreachable:
            raise RecoveryStopped(self._stop(
                f"the job's store is unreachable ({unreachable}), so the survivors cannot "
                f"agree: {self._why_store_gone()}"))

    def _why_store_gone(self) -> str:
        """The likely cause of an unreachable store, by its kind, for the stop message."""
        base = self.store
        while hasattr(base, "underlying_store"):  # torch PrefixStores
            base = base.underlying_store
        if hasattr(base, "probe"):  # resilient.etcd.EtcdStore
            return ("this host cannot reach a majority of the etcd cluster (members down, or "
                    "this host cut off from them); a host cut off from the majority stops "
                    "itself (docs/store.md)")
        return ("it was probably served by a process that died (rank 0 with a bare "
                "init_process_group). Host it outside the ranks: `resilient run`, or an etcd "
                "cluster (init_method=\"etcd://...\", docs/store.md)")

    def _store_unreachable(self) -> str | None:
        """Why the job's store does not answer within 5 s (None when it does)."""
        from resilient.store import unreachable

        if self.store is None:  # unit tests drive the decisions without one
            return None
        return unreachable(self.store, f"resilient/probe/{self.initial_rank}", 5.0)

    def _rebuild(self, gen: int, survivors: list[int]) -> None:
        """The group of generation ``gen``: the survivors, then any hot spares admitted in this
        recovery (resilient.recovery.join.admit_in_recovery), decided once the survivors met."""
        excluded = [i for i, m in enumerate(self.members) if m not in survivors]
        t0 = time.monotonic()
        if self.replicas is not None:  # before their group ends with the old ones (quietly)
            self.replicas.stop()
        if self.store is not None:  # every survivor of `gen` meets first (gate.py says why)
            meet(self.store, f"gen{1000 * gen}", self.initial_rank, survivors,
                 newer=lambda: member_failed(*self.detector.generation, min_generation=gen + 1,
                                             watched=self._watched()),
                 timeout_s=self.config.group_timeout_s)
        members = list(survivors) + admit_in_recovery(self, gen, survivors)
        new_rank, new_size = members.index(self.initial_rank), len(members)
        group, method = None, "reinit"
        # A CheckpointManager follows the default group, which a shrink does not replace.
        if (self.backend == "nccl" and self.config.prefer_shrink and self._group is not None
                and self.manager is None and survivors == members
                and supports_shrink(self._group)):
            retire_groups([self._group])
            wait_for_revoke(self._group, 30.0)  # a shrink frees what the revoke still uses
            group = dist.shrink_group(excluded, self._group, shrink_flags=shrink_abort_flag())
            forget_device_meshes()
            method = "shrink"
        else:
            if dist.is_initialized():
                abort_process_group(background=self.config.revoke_nccl,
                                    on_done=self._abort_finished)
            group = join_process_group(
                self.store, generation=1000 * gen, rank=new_rank, world_size=new_size,
                backend=self.backend, timeout=timedelta(seconds=self.config.group_timeout_s),
                device_id=self._device if self._device.type == "cuda" else None, lazy=True)
        # The old DDP wrapper must go: its reducer's autograd hooks stay on the parameters while
        # it lives. Its reference to the failed group is harmless (the group stays retired).
        self.model = None
        self._group, self.generation = group, gen
        self.members, self.rank, self.world_size = list(members), new_rank, new_size
        self._min_generation = gen + 1
        self.timeline.add("rebuilt", method=method, generation=gen, rank=new_rank,
                          world_size=new_size, seconds=time.monotonic() - t0)

    def _restore(self, holds_state: bool = True) -> None:
        """Makes every member hold the same state (see the module docstring, step 5). Joiners
        admitted in this recovery take part with ``holds_state=False``: their entries are left
        out of the comparison, and they receive the agreed state."""
        if self.build is not None:
            source = sharded.restore(self, holds_state)
            self.timeline.add("restored", source=source, step=self.step)
            return
        starts = [x for pos in self.samplers.start_of(self.step) for x in pos]
        mine = torch.tensor([self.step if holds_state else -1, *starts], dtype=torch.int64,
                            device=self._device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self._wait_work(dist.all_gather(gathered, mine, group=self._group, async_op=True))
        held = [(i, s) for i, s in enumerate(gathered) if int(s[0].item()) >= 0]
        all_steps = [int(s[0].item()) for _, s in held]
        if len(set(all_steps)) == 1 and len({tuple(s.tolist()) for _, s in held}) > 1:
            raise RecoveryStopped(self._stop(
                "the survivors' samplers are at different positions of the epoch (ranks must "
                "draw the same number of samples per step); their data cannot be re-split"))
        source = "memory"
        if len(set(all_steps)) > 1:
            source = "peer"
            if self.config.mismatch_source == "storage" and self.manager is not None:
                loaded = self.manager.restore() or None
                if loaded is not None:
                    self.step, source = loaded, "storage"
            elif self.config.mismatch_source == "storage" and self.checkpointer is not None:
                loaded = self.checkpointer.load(self._state())
                if loaded is not None:
                    self.step, source = loaded, "storage"
            if source == "peer":
                target = max(all_steps)
                self.broadcast_state(held[all_steps.index(target)][0])
                self.step = target
        elif len(held) < self.world_size:  # joiners: the survivors' (equal) state
            self.broadcast_state(held[0][0])
            source = "memory+peer"
        self.optimizer.zero_grad(set_to_none=False)
        self._wrap(init_sync=False)
        self.timeline.add("restored", source=source, step=self.step, steps=all_steps)

    def restore_as_joiner(self) -> None:
        """A joiner admitted during a recovery: the survivors' restore, holding no state (for
        resilient.recovery.join)."""
        self._restore(holds_state=False)

    def broadcast_state(self, src: int) -> None:
        """Copies model, optimizer and extra state from group rank ``src`` to every member
        (how a lagging survivor or a joining rank receives state from a live peer), in place
        and without pickle (resilient.checkpoint.broadcast)."""
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                self._wait_work(dist.broadcast(t.data, group=self._group, group_src=src,
                                                async_op=True))
        step = {"step": self.step, "lr_factor": self.lr_factor}
        state = {"optimizer": self.optimizer, "extra": self.extra_state, "step": step}
        samplers = self.samplers.state(self.step)
        if samplers:
            state["samplers"] = samplers
        broadcast_state(state, src, group=self._group, device=self._device)
        self.step = int(step["step"])
        self.lr_factor = float(step["lr_factor"])  # the optimizer's rates came scaled by it
        if samplers:
            self.samplers.set_state(samplers, self.step)

    def adopt_group(self, group: Any, members: list[int], rank: int) -> None:
        """Makes `group` this rank's process group (the old one is retired, not destroyed: a
        failed peer's group is never waited on). For join.py and the rebuild."""
        retire_groups([self._group])  # never destroyed on this thread
        self.model = None  # the old DDP wrapper's hooks go with it
        self._group, self.members, self.rank, self.world_size = (
            group, list(members), rank, len(members))
        self._awaiting_first = True  # the timeline's first_collective on the grown group

    def _share_manager_state(self, model: torch.nn.Module, optimizer: Any) -> None:
        """The CheckpointManager's further objects (a scheduler, a GradScaler, counters) travel
        with model and optimizer when a joiner or a lagging survivor receives a peer's state:
        a replica with its own scheduler would train on with another learning rate."""
        from resilient.checkpoint.codec import is_stateful

        state = self.manager.state
        if callable(state) and not is_stateful(state):
            state = state()
        if not isinstance(state, dict):
            return
        self.extra_state = dict(self.extra_state)  # the caller's dict stays as it was
        held = {id(v) for v in self.extra_state.values()}
        for key, obj in state.items():
            inner = obj.module if isinstance(obj, DDP) else obj
            if inner is model or inner is self.module or obj is optimizer or id(obj) in held:
                continue
            self.extra_state.setdefault(f"checkpoint/{key}", obj)

    def follow_group(self, lost_rank: bool) -> None:
        """Moves the CheckpointManager (if any) onto the current group: collective over it,
        after a rebuild (``lost_rank``) or an admission. For join.py and the rebuild."""
        if self.manager is None:
            return
        t0 = time.monotonic()
        # gloo: the checkpointer's collectives go over the rebuilt group itself (no second
        # group); NCCL: a gloo group over the same ranks, connected lazily. Either way its
        # connections are made in the checkpointer's first (polled) collectives, and a newer
        # verdict ends those waits (abandon_when).
        if self.backend == "gloo":
            group = self._group
        else:
            with gloo_lazy_init():
                group = dist.new_group(backend="gloo",
                                       timeout=timedelta(seconds=self.config.group_timeout_s))
        with abandon_when(self._newer_verdict):
            lost = self.manager.regroup(lost_rank, group=group)
        self.timeline.add("checkpointer_regrouped", abandoned=lost, world_size=self.world_size,
                          seconds=time.monotonic() - t0)

    def rewrap(self) -> None:
        """Wraps the module in DDP over the current group (after a rebuild or a join)."""
        self.optimizer.zero_grad(set_to_none=False)
        self._wrap(init_sync=False)

    def apply_world(self, world: int) -> None:
        """Applies the smaller-world policy (batch plan, learning rates) for `world` ranks."""
        self._apply(self._decide(world))

    @property
    def device(self) -> torch.device:
        """The device collectives run on."""
        return self._device

    def _apply(self, decision: Decision) -> None:
        if self.samplers.items:
            world, rank = self.data_parallel(self.world_size, self.rank)
            self.samplers.reshard(world, rank, self.step)
        self.plan = decision.plan  # type: ignore[assignment]
        self._scale_lr(decision.lr_factor / self.lr_factor)
        self.lr_factor = decision.lr_factor
        self.timeline.add("policy", message=decision.message, accum_steps=self.plan.accum_steps,
                          global_batch=self.plan.global_batch, lr_factor=decision.lr_factor,
                          world_size=self.world_size, loader_batches=self.loader_batches)

    def _scale_lr(self, ratio: float) -> None:
        """The policy's factor changed by ``ratio``: resilient.recovery.lr scales the rates as
        the schedule left them, and the schedulers' own, each scheduler once."""
        scale_learning_rates(self.optimizer, list(self.extra_state.values()), ratio)
        if ratio != 1.0 and self.lr_factor * ratio != 1.0 and not self._warned_lr:
            self._warned_lr = True
            log.warning("resilient recovery: learning rates x%.4g (scale_lr) while the world is "
                        "smaller; checkpoints saved meanwhile hold the scaled rates, and a job "
                        "restarted from one at another world size does not undo the factor",
                        self.lr_factor * ratio)

    def _decide(self, world: int) -> Decision:
        return decide(self.config.policy, initial_world=self.initial_world, world=world,
                      min_world_size=self.config.min_world, global_batch=self.global_batch,
                      micro_batch=self.micro_batch, whole_batches=bool(self.samplers.items))

    def _stop(self, message: str) -> str:
        from resilient.comm.process_group import abort_revoked

        abort_revoked()  # never rebuilt: a revoked communicator must still be aborted
        self.timeline.add("stopped", reason=message, step=self.step)
        log.error("resilient recovery: %s", message)
        return message

    # ---- helpers ----
    def no_sync(self) -> Any:
        """A context without gradient reduction (accumulating micro-batches): DDP's no_sync,
        FSDP2's set_requires_gradient_sync(False)."""
        if self.build is not None:
            return sharded.no_sync(self.model)
        return self.model.no_sync()

    def _wrap(self, init_sync: bool) -> None:
        if self.build is not None:  # FSDP2 shards over the default group: nothing to wrap
            self.model = self.module
            return
        kwargs = dict(self.ddp_kwargs)
        if self._device.type == "cuda":
            kwargs.setdefault("device_ids", [self._device.index])
        self.model = DDP(self.module, process_group=self._group, init_sync=init_sync, **kwargs)
        if self._device.type != "cuda":
            # A lambda: DDP rejects hooks whose (string) annotations are not GradBucket/Future.
            self.model.register_comm_hook(
                None, lambda state, bucket: self._allreduce_hook(state, bucket))

    def _comm_device(self) -> torch.device:
        if self.backend == "nccl":
            p = next(self.module.parameters())
            if p.device.type == "cuda":
                return p.device
            bound = getattr(dist.group.WORLD, "bound_device_id", None) \
                if dist.is_initialized() else None  # init_process_group(device_id=...)
            return bound if bound is not None else torch.device(
                "cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _state(self) -> dict:
        return {"model": self.module, "optimizer": self.optimizer, "extra": self.extra_state}

    def _maybe_checkpoint(self) -> None:
        if self.manager is not None:
            self.manager.step(self.step)
        if (self.checkpointer is not None and self.checkpoint_every > 0 and self.rank == 0
                and self.step % self.checkpoint_every == 0):
            self.checkpointer.save(self.step, self._state())

    def _run_hooks(self, point: str) -> None:
        for hook in self.fault_hooks[point]:
            hook(self)


__all__ = ["FAULT_POINTS", "PeerFailure", "Recovery", "RecoveryStopped"]
