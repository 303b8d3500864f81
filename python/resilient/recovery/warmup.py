"""NCCL connections of a rebuilt sharded model made while its state is restored, and a waiting
spare's compute warmed before it is needed.

NCCL connects a communicator's peers at the first collective that needs them (per algorithm:
ring, tree, NVLS), not at its creation. After a rebuild that first collective was FSDP2's first
all-gather, so the connections sat between the restore and the first step (about 0.2-0.5 s on
2 H200s, benchmarks/RESULTS.md). :class:`Warmup` issues the collectives FSDP2 and HSDP will issue,
at the sizes they will use, on a thread of their own over every NCCL group of the model's
meshes, while the training thread restores the state over gloo; :meth:`Warmup.finish` waits for
them.
Every member runs the same warm-up, in the same order, so the groups' sequence numbers stay in
step: its sizes come from the unsharded model, and a rank that cannot allocate its buffers
makes every rank skip the rest (:func:`vote`). The optimizer's state is created before the
thread starts (its step may communicate), and nothing else uses these groups until
:meth:`Warmup.finish` returned. ``RESILIENT_RECOVERY_WARM_NCCL`` must be the same on every rank.

A spare or restarted rank runs its process's first forward, backward and optimizer step on
its device in the first step after it joined; :func:`warm_compute` runs small ones while it
waits (``RESILIENT_RECOVERY_WARM_SPARE``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("resilient.recovery")

#: the largest buffer a warm-up collective gathers into (algorithms do not change above it)
MAX_BYTES = 256 << 20
#: a small collective's elements (the small-message algorithms and protocols)
SMALL = 1024


def mesh_groups(module: torch.nn.Module) -> list:
    """The distinct NCCL process groups of the module's DTensor parameters' device meshes."""
    groups: dict[int, Any] = {}
    for p in module.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        for g in mesh.get_all_groups():
            groups.setdefault(id(g), g)
    from resilient.comm.process_group import nccl_backend

    return [g for g in groups.values() if nccl_backend(g) is not None]


def unit_sizes(module: torch.nn.Module) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of each FSDP2 unit's own parameters (those not under a nested unit),
    unsharded: the same on every rank, whatever its shard of an uneven split holds. The dtype
    is the one FSDP2 gathers in: the unit's mixed-precision ``param_dtype``, else the
    parameters'."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    sizes = []
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in reversed(units):  # nested units first: their parameters are theirs
        numel, dtype = 0, _gather_dtype(unit)
        for p in unit.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            numel += p.numel()  # a DTensor's global size
            dtype = dtype or p.dtype
        if numel:
            sizes.append((numel, dtype))
    return sizes


def _gather_dtype(unit: Any) -> torch.dtype | None:
    try:
        return unit._get_fsdp_state()._mp_policy.param_dtype  # private: torch 2.6-2.11
    except AttributeError:
        return None


def plan(module: torch.nn.Module) -> list[tuple[int, torch.dtype]]:
    """The sizes to warm (unsharded elements, dtype): a small collective and the largest
    unit, per dtype."""
    by_dtype: dict[torch.dtype, int] = {}
    for numel, dtype in unit_sizes(module):
        by_dtype[dtype] = max(by_dtype.get(dtype, 0), numel)
    return [(n, dtype) for dtype, largest in by_dtype.items()
            for n in sorted({min(SMALL, largest), largest})]


def allocate(groups: list, sizes: list[tuple[int, torch.dtype]], device: torch.device) -> list:
    """The buffers of :func:`issue`: (group, shard, full) per group and size (unsharded
    elements: each rank sends its even share, up to :data:`MAX_BYTES` gathered). Every rank of
    a group must pass the same sizes."""
    buffers = []
    for group in groups:
        world = dist.get_world_size(group)
        for numel, dtype in sizes:
            elem = torch.empty((), dtype=dtype).element_size()
            n = max(1, min(-(-numel // world), MAX_BYTES // (elem * world)))
            buffers.append((group, torch.zeros(n, dtype=dtype, device=device),
                            torch.zeros(n * world, dtype=dtype, device=device)))
    return buffers


def vote(groups: list, ready: bool, device: torch.device) -> bool:
    """Whether every rank of every group is ready (an all-reduce of one flag per group): a
    rank that could not allocate its buffers makes every rank skip the warm-up, rather than
    leave collectives its peers issued unmatched."""
    flag = torch.tensor([int(ready)], dtype=torch.int32, device=device)
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def issue(buffers: list) -> list:
    """An all-gather, a reduce-scatter and an all-reduce of each buffer on its group,
    asynchronously; returns their works."""
    works = []
    for group, shard, full in buffers:
        works.append(dist.all_gather_into_tensor(full, shard, group=group, async_op=True))
        works.append(dist.reduce_scatter_tensor(shard, full, group=group, async_op=True))
        works.append(dist.all_reduce(shard, group=group, async_op=True))
    return works


class Warmup:
    """The warm-up thread of one restore (see the module docstring): ``sizes`` (elements,
    dtype) warmed on each of ``groups`` on ``device``."""

    def __init__(self, groups: list, sizes: list[tuple[int, torch.dtype]],
                 device: torch.device) -> None:
        self.groups, self.sizes, self.device = groups, sizes, device
        self.buffers: list = []
        self.works: list = []
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        #: seconds from start() to each phase's end (allocated, voted, issued, completed)
        self.phases: dict[str, float] = {}
        self._t0 = 0.0
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, module: torch.nn.Module, device: torch.device, *,
                  enabled: bool = True) -> Warmup:
        """The warm-up of a model sharded on ``device``: none unless it is a GPU and
        ``enabled``."""
        groups = mesh_groups(module) if enabled and device.type == "cuda" else []
        return cls(groups, plan(module) if groups else [], device)

    def _mark(self, phase: str) -> None:
        self.phases[phase] = round(time.monotonic() - self._t0, 4)

    def start(self) -> Warmup:
        self._t0 = time.monotonic()
        if self.groups and self.sizes:
            self.thread = threading.Thread(target=self._run, name="resilient-nccl-warmup",
                                           daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":  # the current device is the thread's own
                torch.cuda.set_device(self.device)
            try:
                self.buffers = allocate(self.groups, self.sizes, self.device)
            except torch.OutOfMemoryError as exc:
                log.warning("resilient recovery: no NCCL warm-up (%s)",
                            str(exc).splitlines()[0])
            self._mark("allocated")
            # Each group on a thread of its own: NCCL connects a communicator's peers on the
            # thread that issues its first collective, so HSDP's three groups, connected one
            # after the other, took 0.6 s on 4 H200s.
            voted: list[float] = []
            threads = [threading.Thread(target=self._connect, args=(g, voted), daemon=True,
                                        name="resilient-nccl-warmup-group")
                       for g in self.groups]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if voted:
                self.phases["voted"] = max(voted)
                self._mark("issued")
        except BaseException as exc:  # noqa: BLE001 -- reported by finish()
            self.error = exc

    def _connect(self, group: Any, voted: list[float]) -> None:
        """One group's vote, then its collectives (appended to ``works``)."""
        try:
            where: Any = contextlib.nullcontext()
            if self.device.type == "cuda":
                # A stream of its own: on the default stream, shared by these threads, one
                # group's collective would wait for another's (a synchronous collective makes
                # the current stream wait for it), in an order that differs between ranks.
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.default_stream(self.device))  # the buffers
                where = torch.cuda.stream(stream)
            with where:
                if vote([group], bool(self.buffers), self.device):
                    with self._lock:
                        voted.append(round(time.monotonic() - self._t0, 4))
                    works = issue([b for b in self.buffers if b[0] is group])
                    with self._lock:
                        self.works += works
        except BaseException as exc:  # noqa: BLE001 -- reported by finish()
            with self._lock:
                self.error = self.error or exc

    def finish(self, poll: Any) -> bool:
        """Waits for the thread and its collectives with ``poll(done, finish)`` (the training
        thread's, which raises PeerFailure on a verdict); returns whether anything was warmed.

        Raises:
            RuntimeError: issuing failed on this rank (an NCCL error: its peers may have
                issued collectives that this rank did not, so the groups cannot be trusted).
        """
        if self.thread is None:
            return False
        poll(lambda: not self.thread.is_alive(), lambda: None)
        if self.error is not None:
            raise RuntimeError(f"warming the new NCCL groups failed: {self.error}") from (
                self.error)
        for work in self.works:
            poll(work.is_completed, work.wait)
        self._mark("completed")
        self.buffers = []
        return bool(self.works)

    def abandon(self, timeout_s: float = 5.0) -> None:
        """The restore failed: waits (bounded) until the thread issued what it will issue, so
        the next rebuild does not abort a communicator this thread is still calling."""
        if self.thread is not None:
            self.thread.join(timeout_s)


#: the dtypes warm_compute runs in (float8 has no randn or GEMM of this kind)
COMPUTE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def warm_compute(device: torch.device, dtypes: set[torch.dtype]) -> float:
    """Runs a small forward, backward and foreach update in each of ``dtypes`` (the model's)
    on ``device``, on the calling thread (the training thread: cuBLAS handles are per thread):
    the process's first GEMM creates its cuBLAS handle and workspace, its first backward
    starts the autograd engine's device thread, and CUDA loads each kernel at its first
    launch. Nothing on CPU. Returns seconds spent."""
    t0 = time.monotonic()
    if device.type != "cuda":
        return 0.0
    from torch.nn import functional

    for dtype in sorted((dtypes & COMPUTE_DTYPES) | {torch.float32}, key=str):
        w = torch.randn(256, 256, device=device, dtype=dtype, requires_grad=True)
        x = torch.randn(64, 256, device=device, dtype=dtype)
        functional.linear(torch.tanh(functional.linear(x, w)), w).float().square().mean(
            ).backward()
        assert w.grad is not None
        torch._foreach_add_([w.detach()], [w.grad], alpha=-1e-3)
    torch.cuda.synchronize(device)
    return time.monotonic() - t0


__all__ = ["Warmup", "allocate", "issue", "mesh_groups", "plan", "unit_sizes", "vote",
           "warm_compute"]
