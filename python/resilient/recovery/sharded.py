"""Recovery of sharded models (FSDP2, ``fully_shard``): ``Recovery.adopt(model, opt,
build=make_model)``.

A sharded model cannot simply be re-wrapped over the survivors' group as DDP is: its parameters
are DTensors of the old group's mesh, and the lost rank's shard exists nowhere else. So:

* after every step, each rank's shards are replicated to peers' host memory in the background
  (resilient.recovery.replica; ``RESILIENT_REPLICA_FACTOR`` peers on other hosts);
* after the rebuild, ``build()`` (the user's function that creates the model and shards it over
  the current default group, as at start) makes the model again on the new group; the user's
  optimizer is pointed at its parameters (same names), so schedulers that hold the optimizer
  keep working;
* every member (survivors and hot spares) fills it from memory (resilient.recovery.reshard):
  the newest step whose shards are all held and verified; a lagging replica means every rank
  goes back to that step, with the schedulers' states, the samplers' positions and the
  learning-rate factor of that step, which travel with the snapshot. When memory holds no
  complete step, the CheckpointManager's newest checkpoint is loaded, or the job stops.

The loop uses ``rec.model`` (the model changes) and the optimizer it passed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from resilient.comm.process_group import retire_groups
from resilient.recovery.decisions import RecoveryStopped

log = logging.getLogger("resilient.recovery")


def check(rec: Any) -> None:
    """Refuses what the sharded path cannot do (at construction)."""
    if not isinstance(rec.optimizer, torch.optim.Optimizer):
        raise TypeError("Recovery(build=...) needs a torch.optim.Optimizer (its parameters are "
                        "moved onto the rebuilt model)")
    others = [k for k, v in rec.extra_state.items() if isinstance(v, torch.optim.Optimizer)
              and v is not rec.optimizer]
    if others:
        raise ValueError(f"Recovery(build=...) moves one optimizer onto the rebuilt model; "
                         f"{others} hold further optimizers, which would go on updating the "
                         "old model's parameters")
    if rec.manager is not None and not isinstance(getattr(rec.manager, "state", None), dict):
        raise ValueError("Recovery(build=...) with a CheckpointManager needs its state as a "
                         "dict (the rebuilt model replaces the old one in it)")


def poll_collectives(rec: Any, module: torch.nn.Module) -> None:
    """On gloo: FSDP2's all-gathers and reduce-scatters are issued asynchronously and polled
    by the training thread while it watches the verdict (``Recovery._wait_work``), as the DDP
    comm hook does (a reduce-scatter as an all-reduce: gloo's cannot be polled). gloo cannot
    abort a collective that waits on a healthy peer which left it (docs/comm.md), so without
    this a survivor could wait for the group timeout. NCCL needs
    none: the detector's thread revokes (or aborts) the communicator."""
    if rec.backend != "gloo":
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class PolledAllGather(DefaultAllGather):
        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any,
                     async_op: bool = False) -> Any:
            work = super().__call__(output_tensor, input_tensor, group, async_op=True)
            rec._wait_work(work)
            rec._first_collective_done()
            return work if async_op else None

    class PolledReduceScatter(DefaultReduceScatter):
        # gloo's reduce_scatter work reports completion only from wait(): an all-reduce of
        # FSDP2's (temporary) input buffer, which can be polled, then this rank's chunk of it
        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            work = dist.all_reduce(input_tensor, op=op, group=group, async_op=True)
            rec._wait_work(work)
            n, me = output_tensor.numel(), dist.get_rank(group)
            output_tensor.view(-1).copy_(input_tensor.view(-1)[me * n:(me + 1) * n])
            rec._first_collective_done()
            return work if async_op else None

    gather, scatter = PolledAllGather(), PolledReduceScatter()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
    _poll_hsdp_all_reduce(rec)


class _PolledDist:
    """torch.distributed as FSDP2's collectives module sees it, except that its one collective
    without a custom hook, HSDP's gradient all-reduce over the replicate dimension, is issued
    asynchronously and polled (a rank waiting there for a partner that already went into
    recovery would otherwise wait for the group timeout, and be taken for hung)."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        if async_op:
            return work
        self.rec._wait_work(work)
        return None


def unpoll_hsdp_all_reduce(rec: Any) -> None:
    """At ``rec.close()``: FSDP2's collectives module gets torch.distributed back, unless a
    newer Recovery polls it now."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    current = getattr(_fsdp_collectives, "dist", None)
    if isinstance(current, _PolledDist) and current.rec is rec:
        _fsdp_collectives.dist = dist


def _poll_hsdp_all_reduce(rec: Any) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    current = getattr(_fsdp_collectives, "dist", None)
    if isinstance(current, _PolledDist):
        current.rec = rec  # the newest Recovery of this process
    elif current is dist:
        _fsdp_collectives.dist = _PolledDist(rec)
    else:  # another torch layout: say so rather than leave HSDP's all-reduce unpolled silently
        log.warning("resilient recovery: FSDP2's HSDP all-reduce is not polled on this torch "
                    "version; a survivor may wait in it until the group timeout")


def start_replicas(rec: Any, group: Any = None) -> None:
    """Starts peer replication of the current model over the current group (collective;
    `group`: a gloo group over it to use, see :func:`restore`), and notes the names of its
    (sharded) parameters: during a step FSDP2 registers the unsharded ones, so a failure
    mid-step would find other objects there."""
    from resilient.recovery.replica import PeerReplicas, replica_group

    rec._param_names = {id(p): n for n, p in rec.module.named_parameters()}
    if group is None:
        group = replica_group(rendezvous_s=rec.config.group_timeout_s)
    rec.replicas = PeerReplicas(rec.module, rec.optimizer, group=group, wait=rec._wait_work)


def replicate(rec: Any) -> None:
    """After a completed step: snapshot and send (skipped while the previous one is in flight)."""
    if rec.replicas is not None:
        rec.replicas.replicate(rec.step, extra=_extra(rec))


def snapshot_now(rec: Any) -> None:
    """Before a joiner grows the group: the members' current state, for the restore."""
    if rec.replicas is not None:
        rec.replicas.snapshot_now(rec.step, extra=_extra(rec))


def _extra(rec: Any) -> dict:
    objects = {}
    for key, obj in rec.extra_state.items():
        if isinstance(obj, torch.optim.Optimizer) or not hasattr(obj, "state_dict"):
            continue
        objects[key] = obj.state_dict()
    return {"lr_factor": rec.lr_factor, "samplers": rec.samplers.state(rec.step),
            "objects": objects}


@contextlib.contextmanager
def no_sync(model: Any) -> Iterator[None]:
    """Gradient accumulation without reduction for one micro-batch (FSDP2's switch)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                     new: torch.nn.Module) -> None:
    """Points `optimizer`'s groups at `new`'s parameters of the same names (`names`: the old
    parameters' ids to their names) and empties its state (the restore fills it)."""
    params = dict(new.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [params[names[id(p)]] for p in group["params"]]
        except KeyError as e:
            raise ValueError(f"build() made a model without the parameter {e} that the "
                             "optimizer holds") from e
    optimizer.state = collections.defaultdict(dict)


def restore(rec: Any, holds_state: bool) -> str:
    """Builds the model on the new group and fills it from memory (else storage); returns the
    source. Collective over the new group."""
    from resilient.recovery.replica import replica_group
    from resilient.recovery.reshard import ReplicaUnavailable, restore_sharded
    from resilient.recovery.warmup import Warmup

    old_replicas = rec.replicas if holds_state else None
    if old_replicas is not None:
        old_replicas.stop()  # kept on rec until a restore succeeded (a second failure retries)
    names = getattr(rec, "_param_names", None) or {
        id(p): n for n, p in rec.module.named_parameters()}
    t_build = time.monotonic()
    module = rec.build()
    rec.timeline.add("model_built", seconds=round(time.monotonic() - t_build, 4))
    if any(p.device.type == "meta" for p in module.parameters()):
        raise RecoveryStopped(rec._stop("build() made a model on the meta device: it must "
                                        "build the real model (a joiner's first model alone "
                                        "may be on meta: resilient.joining() is False by now)"))
    poll_collectives(rec, module)
    rebind_optimizer(rec.optimizer, names, module)
    rec._param_names = {id(p): n for n, p in module.named_parameters()}
    # The old model is dropped (its shards and buffers freed); its meshes, which hold the old
    # groups, stay referenced: a group's destructor may block on a dead peer.
    retire_groups(list({id(p.device_mesh): p.device_mesh for p in rec.module.parameters()
                         if hasattr(p, "device_mesh")}.values()))
    _replace_in_manager(rec, rec.module, module)
    rec.module = rec.model = module
    # One gloo group for the restore's exchange and then the new replicas (a group costs a
    # rendezvous of every rank; on NCCL jobs the gather of hosts also stays off the GPU).
    # NCCL connects the new groups on a thread of its own meanwhile (warmup.py)
    # The optimizer's state is created before the warm-up starts where its step may
    # communicate, and meanwhile otherwise (a joiner's first step of an optimizer over DTensors
    # took 0.25 s on an H200: DTensor's sharding propagation of each op, then cached).
    quiet = _step_is_local(rec.optimizer)
    warmup = Warmup.for_model(module, rec.device, enabled=rec.config.warm_nccl and (
        quiet or _init_optimizer_state(rec.optimizer))).start()
    try:
        if quiet:
            _init_optimizer_state(rec.optimizer)
        rec.timeline.add("optimizer_ready")
        group = replica_group(rendezvous_s=rec.config.group_timeout_s)
        restored = restore_sharded(module, rec.optimizer, old_replicas, group=group,
                                   wait=rec._wait_work)  # polled: a peer lost meanwhile
    except ReplicaUnavailable as e:
        warmup.finish(rec._poll)  # the storage path's collectives come after it
        if rec.manager is None:
            raise RecoveryStopped(rec._stop(f"the lost shard is not in memory ({e}) and there "
                                            "is no CheckpointManager to load from")) from e
        step = rec.manager.restore()
        if step is None:
            raise RecoveryStopped(rec._stop(f"the lost shard is not in memory ({e}) and no "
                                            "checkpoint is committed")) from e
        rec.step = step
        source = "storage"
    except BaseException:
        warmup.abandon()  # the next rebuild aborts these groups: not while it issues on them
        raise
    else:
        rec.timeline.add("replica_restored", step=restored.step,
                         bytes_received=restored.bytes_received,
                         bytes_local=restored.bytes_local, seconds=restored.seconds)
        if warmup.finish(rec._poll):  # before the user's objects load (their own collectives)
            rec.timeline.add("nccl_warmed", groups=len(warmup.groups), sizes=len(warmup.sizes),
                             **warmup.phases)
        rec.step = restored.step
        _apply_extra(rec, restored.extra)
        source = "replica"
    rec.optimizer.zero_grad(set_to_none=True)
    if old_replicas is not None:
        old_replicas.release()
    start_replicas(rec, group)
    return source


#: torch.optim's optimizers whose step is elementwise on DTensors (no collective). Not Muon
#: or Adafactor (norms over a sharded dimension), nor any subclass (its step may differ).
_LOCAL_STEP = frozenset(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop",
    "ASGD", "Rprop") if hasattr(torch.optim, n))


def _step_is_local(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step issues no collective: one of :data:`_LOCAL_STEP` exactly.
    Any other (LAMB, Muon, Shampoo, ZeRO, a subclass, a wrapper) may."""
    return type(optimizer) in _LOCAL_STEP


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Creates the optimizer's state now, as the restore's ``get_state_dict`` would (a step
    with zero gradients and rates): an optimizer that communicates in its step (norms over
    DTensors: LAMB, Muon, Shampoo) must do so before the warm-up's thread issues on the same
    groups, not during it. False (no warm-up) where torch has no such helper."""
    try:
        from torch.distributed.checkpoint.state_dict import _init_optim_state
    except ImportError:
        return False
    _init_optim_state(optimizer)
    return True


def _apply_extra(rec: Any, extra: dict) -> None:
    rec.lr_factor = float(extra.get("lr_factor", rec.lr_factor))
    for key, state in extra.get("objects", {}).items():
        obj = rec.extra_state.get(key)
        if obj is not None:
            obj.load_state_dict(state)
    samplers = extra.get("samplers")
    if samplers:
        rec.samplers.set_state(samplers, rec.step)


def _replace_in_manager(rec: Any, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """The CheckpointManager saves the model it was given: the rebuilt one from now on."""
    state = getattr(rec.manager, "state", None)
    if isinstance(state, dict):
        for key, obj in list(state.items()):
            if obj is old:
                state[key] = new


__all__ = ["check", "no_sync", "rebind_optimizer", "replicate", "restore", "snapshot_now",
           "start_replicas", "unpoll_hsdp_all_reduce"]
