"""Rebuilding torch.distributed process groups for a new membership after a rank fails.

Two paths, chosen per group:

* **shrink** — where the backend supports it (``ProcessGroupNCCL`` with NCCL >= 2.27 in torch
  2.11: ``torch.distributed.shrink_group``), the survivors shrink the failed group in place,
  excluding the failed ranks (``SHRINK_ABORT`` first stops in-flight work);
* **reinit** — otherwise (gloo, older NCCL, or when spares join): abort the failed group, destroy
  it, and create a new default group under a generation-prefixed store
  (``gen<g>/`` key prefix), so keys of the failed generation can never be mixed with
  the new one.

Survivors keep their order and close the gaps (old rank 3 of 4 becomes rank 2 of 3 when rank 1
leaves), exactly as ncclCommShrink does; spares or restarted ranks take the ranks after the
survivors and call :func:`join_process_group` with the same generation.

The caller (the recovery loop) decides *which* ranks left and agrees on the generation; these
helpers only rebuild. Every step is timed for the recovery timeline.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resilient.comm import TORCH_NAMES
from resilient.comm.nccl_env import prepare_nccl_env

__all__ = sorted(TORCH_NAMES)  # resilient.comm names them without importing torch

log = logging.getLogger("resilient.comm")


def shrink_abort_flag() -> int:
    """torch's SHRINK_ABORT flag (defined in distributed_c10d; not every torch re-exports it)."""
    from torch.distributed import distributed_c10d

    return int(getattr(distributed_c10d, "SHRINK_ABORT", 1))


@dataclass
class RebuildTimings:
    """Seconds spent in each phase of a rebuild (``time.monotonic`` differences)."""

    method: str = ""  #: "shrink" or "reinit"
    abort_s: float = 0.0  #: aborting and destroying the failed group (0 for shrink)
    rebuild_s: float = 0.0  #: shrink_group, or init_process_group of the new generation
    first_collective_s: float = 0.0  #: the verifying all_reduce on the new group

    def as_dict(self) -> dict[str, Any]:
        """The timings as a JSON-ready dict."""
        return asdict(self)


@dataclass
class RebuildResult:
    """The rebuilt group and this process's place in it."""

    group: Any  #: the new ProcessGroup (the new default group for reinit)
    rank: int
    world_size: int
    generation: int
    timings: RebuildTimings = field(default_factory=RebuildTimings)


def survivor_rank(old_rank: int, old_size: int, excluded: Sequence[int]) -> int:
    """The rank ``old_rank`` gets once ``excluded`` leave (order kept, gaps closed).

    Raises:
        ValueError: ``old_rank`` is excluded, or ``excluded`` has a duplicate or a rank outside
            ``[0, old_size)``.
    """
    ex = sorted(excluded)
    if len(set(ex)) != len(ex):
        raise ValueError(f"excluded ranks contain a duplicate: {list(excluded)}")
    if any(r < 0 or r >= old_size for r in ex):
        raise ValueError(f"excluded ranks {ex} outside [0, {old_size})")
    if old_rank in ex:
        raise ValueError(f"rank {old_rank} is itself excluded")
    return old_rank - sum(1 for r in ex if r < old_rank)


def generation_store(store: Any, generation: int) -> Any:
    """The namespace of one generation's group: keys become ``gen<generation>/<key>``
    (torch's PrefixStore inserts the ``/`` itself)."""
    return dist.PrefixStore(f"gen{generation}", store)


def _any_backend(group: Any) -> Any | None:
    """The backend of ``group``'s bound device, else its CUDA one, else its CPU one."""
    device = getattr(group, "bound_device_id", None)
    candidates = [device] if device is not None else []
    candidates += [torch.device("cuda"), torch.device("cpu")]
    for dev in candidates:
        backend = backend_of(group, dev)
        if backend is not None:
            return backend
    return None


def supports_shrink(group: Any | None = None) -> bool:
    """True when ``torch.distributed.shrink_group`` exists and ``group``'s backend can shrink."""
    if not hasattr(dist, "shrink_group"):
        return False
    group = group if group is not None else dist.group.WORLD
    backend = _any_backend(group)
    try:
        return bool(backend is not None and backend.supports_shrinking)
    except (AttributeError, RuntimeError):
        return False


# The graveyard: groups given up after a failure (and objects that hold them: DDP wrappers,
# device meshes), each with the monotonic time its own timeout has passed by. Their C++
# destructors join backend threads, and a gloo thread stuck in a collective with a dead or frozen
# rank only returns at the group's timeout: dropping the last reference would block the caller
# for that long (measured: 20 s with a 20 s timeout; a frozen peer of a checkpoint's planning
# group held every survivor until its hang watchdog evicted it). They are kept here until
# release_retired_groups() drops them on a thread of its own. The list is never freed, not even
# when the interpreter clears this module at exit: its groups' destructors never run on the
# exiting main thread (nor in a process that leaves through os._exit).
_RETIRED: list[tuple[float, Any]] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_RETIRED))
_RETIRED_LOCK = threading.Lock()
_DEFAULT_TIMEOUT_S = 1800.0  # torch's default for gloo; a group whose own cannot be read


def _group_timeout_s(pg: Any) -> float:
    """The longest collective timeout of ``pg``'s backends (torch's default when unreadable)."""
    found = []
    for kind in ("cpu", "cuda"):
        try:
            found.append(pg._get_backend(torch.device(kind)).options._timeout.total_seconds())
        except (AttributeError, RuntimeError, ValueError):
            continue
    return max(found) if found else _DEFAULT_TIMEOUT_S


def retire_groups(groups: Sequence[Any]) -> None:
    """Keeps ``groups`` (process groups, or objects that hold some: a DDP wrapper, a device
    mesh) referenced until their own collective timeout has passed, then lets
    :func:`release_retired_groups` drop them on a thread of its own: a group given up after a
    failure is never destroyed on the caller's thread, nor at interpreter exit (a destructor
    joins the backend's threads, which may wait for a dead or frozen peer until that timeout).
    Safe from any thread; a group already retired is not added twice."""
    now = time.monotonic()
    with _RETIRED_LOCK:
        held = {id(g) for _, g in _RETIRED}
        for g in groups:
            if g is not None and id(g) not in held:
                held.add(id(g))
                _RETIRED.append((now + _group_timeout_s(g), g))



def abort_process_group(group: Any | None = None, *, revoke: bool = False,
                        background: bool = False,
                        on_done: Callable[[float], None] | None = None) -> float:
    """Aborts in-flight work on ``group`` (default: the default group, and with it every other
    NCCL group: a device mesh's dimensions) and destroys it.

    Never waits for peers: ``ProcessGroup.abort`` tears down communicators without a barrier,
    and the group object is retired (kept referenced) so its destructor cannot block on a
    collective still waiting for the dead rank. Destroying the default group destroys every
    other group too.

    With ``background`` (the default group only), the NCCL groups are aborted on threads of
    their own (:func:`start_aborts`; call :func:`wait_for_aborts` before the process exits, which
    may crash amid an NCCL abort) and taken out of torch's registry without waiting: an NCCL
    abort joins its communicator's proxy threads, which poll with a 0.5 s timeout, and a new
    default group can be created meanwhile. ``revoke`` first revokes their communicators;
    ``on_done(seconds)`` is called when the last of these aborts ended.

    Returns:
        seconds spent.
    """
    t0 = time.monotonic()
    if not dist.is_initialized():
        return 0.0
    pg = group if group is not None else dist.group.WORLD
    if group is not None:
        retire_groups([pg])
        abort_groups([pg])
        dist.destroy_process_group(group)
        return time.monotonic() - t0
    # The default group's destruction shuts every other group down too; the NCCL ones (a
    # device mesh's dimensions: HSDP, tensor parallel) may have work waiting on the dead rank,
    # so they are aborted first, not finalized.
    nccl = nccl_groups()
    groups = with_nccl_groups(pg, nccl)
    retire_groups(groups)
    if not background:
        abort_groups(groups)
        dist.destroy_process_group()
        return time.monotonic() - t0
    start_aborts([g for g in groups if g in nccl], revoke=revoke, on_done=on_done)
    abort_groups([g for g in groups if g not in nccl])
    # torch's destroy_process_group shuts down every registered group, and an NCCL group's
    # shutdown waits for the abort under way (the backend's lock). Unregistered first, they
    # are left to their abort threads (and kept referenced in _RETIRED).
    names = dist.distributed_c10d._world.pg_names
    for g in groups:
        if g in nccl:
            names.pop(g, None)
    dist.destroy_process_group()
    return time.monotonic() - t0


# NCCL groups being aborted on threads of their own, and groups whose communicators were
# revoked (the event is set once the revoke returned), by id; the entries keep the groups alive.
_ABORTS: dict[int, tuple[Any, threading.Thread]] = {}
_REVOKES: dict[int, tuple[Any, threading.Event]] = {}
_ABORTS_LOCK = threading.Lock()


def start_aborts(groups: Sequence[Any], *, revoke: bool = False,
                 on_done: Callable[[float], None] | None = None) -> int:
    """Aborts each of ``groups`` on a thread of its own and returns at once; a group whose
    abort already started is skipped. ``revoke``: first revoke their NCCL communicators
    (:func:`revoke_groups`), so that a thread blocked in one of their operations returns within
    milliseconds instead of when the abort ends. A group revoked on another thread is aborted
    once that revoke returned (an abort frees the communicator the revoke is still using).
    ``on_done(seconds)`` is called on the last thread to finish. :func:`wait_for_aborts` waits
    for them.

    Returns:
        how many communicators were revoked.
    """
    revoked = revoke_groups(groups) if revoke else 0
    t0 = time.monotonic()
    with _ABORTS_LOCK:
        todo = [(g, _REVOKES.get(id(g), (None, None))[1]) for g in groups if id(g) not in _ABORTS]
        left = [len(todo)]

        def abort(pg: Any, revoking: threading.Event | None) -> None:
            if revoking is not None and not revoking.wait(30.0):
                # an abort would free the communicator the revoke still uses
                log.warning("an NCCL revoke has not returned after 30 s; its group is left "
                            "unaborted")
            else:
                _abort_one(pg)
            with _ABORTS_LOCK:
                left[0] -= 1
                last = left[0] == 0
            if last and on_done is not None:
                on_done(time.monotonic() - t0)

        for g, revoking in todo:
            t = threading.Thread(target=abort, args=(g, revoking), daemon=True,
                                 name="resilient-abort")
            _ABORTS[id(g)] = (g, t)
            t.start()
    return revoked


def wait_for_aborts(timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` in all for the aborts :func:`start_aborts` began. Returns True
    when none is left running."""
    deadline = time.monotonic() + timeout_s
    with _ABORTS_LOCK:
        threads = [t for _, t in _ABORTS.values()]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def revoke_groups(groups: Sequence[Any], device: torch.device | None = None, *,
                  wait_s: float = 2.0) -> int:
    """``ncclCommRevoke`` on the communicator of each NCCL group in ``groups``, each on a
    thread of its own: its in-flight operations end at once and later ones fail (the call
    itself may return later, and may wait for the device while another group's kernel is still
    stuck on a dead peer: revoked one after the other, HSDP's groups never all were). Done only
    where torch's NCCL has revoke (>= 2.28.7) and is the very library resilient loads (a
    communicator handed to another copy of NCCL would be memory corruption), and never on a
    group already revoked or whose abort began (:func:`start_aborts`).

    ``device``: the groups' CUDA device (default: each group's bound device, else the current
    one). torch finds a group's communicator by the calling thread's current device, which on
    a thread other than the training thread is device 0. Errors are logged and otherwise
    ignored (the abort that follows still ends the group). Waits up to ``wait_s`` for every
    revoke to be issued, not for it to return.

    Returns:
        how many revokes were issued.
    """
    lib = _torch_nccl()
    if lib is None:
        return 0
    with _ABORTS_LOCK:  # registered first, so an abort started meanwhile waits for the revoke
        mine = [(g, threading.Event()) for g in groups
                if id(g) not in _ABORTS and id(g) not in _REVOKES]
        for g, done in mine:
            _REVOKES[id(g)] = (g, done)
    current = (torch.device("cuda", torch.cuda.current_device())  # the caller's, not the
               if device is None and torch.cuda.is_available() else None)  # new threads'
    issues = [_Issue() for _ in mine]

    def revoke(g: Any, done: threading.Event, issue: _Issue) -> None:
        try:
            _revoke(lib, g, device, issue, current)
        finally:
            issue.decided.set()
            done.set()

    for (g, done), issue in zip(mine, issues):
        threading.Thread(target=revoke, args=(g, done, issue), daemon=True,
                         name="resilient-revoke").start()
    deadline = time.monotonic() + wait_s
    for issue in issues:
        issue.decided.wait(max(0.0, deadline - time.monotonic()))
    return sum(issue.issued for issue in issues)


@dataclass
class _Issue:
    """One revoke thread's progress: ``decided`` once it issued the revoke (``issued``) or
    found nothing to revoke."""

    decided: threading.Event = field(default_factory=threading.Event)
    issued: bool = False


def _revoke(lib: Any, g: Any, device: torch.device | None, issue: _Issue,
            current: torch.device | None) -> None:
    """Revokes ``g``'s communicator (``issue`` marked just before the call) on ``device``, else
    its bound device, else ``current``."""
    backend = nccl_backend(g)
    if backend is None:
        return
    dev = device or getattr(g, "bound_device_id", None) or current
    index = dev.index if isinstance(dev, torch.device) and dev.type == "cuda" else None
    switch = torch.cuda.device(index) if index is not None else contextlib.nullcontext()
    try:
        with switch:
            ptr = backend._comm_ptr()
        if ptr:
            issue.issued = True
            issue.decided.set()
            lib.revoke_comm(ptr)
    except (AttributeError, RuntimeError, ValueError) as exc:
        log.warning("NCCL group %s is aborted without a revoke first: %s", g, exc)


_TORCH_NCCL: list[Any] = []


def _torch_nccl() -> Any | None:
    """resilient's NcclLibrary when it is the NCCL torch's CUDA library uses and has revoke
    (checked once: both resolve ``ncclCommRevoke`` to the same address), else None."""
    if not _TORCH_NCCL:
        _TORCH_NCCL.append(_find_torch_nccl())
    return _TORCH_NCCL[0]


def _find_torch_nccl() -> Any | None:
    import ctypes
    from pathlib import Path

    try:
        from resilient.comm.native import load_nccl

        lib = load_nccl()
        if not lib.supports("revoke"):
            raise RuntimeError(f"NCCL {lib.version_string} has no ncclCommRevoke")
        rtld_noload = 4 | 2  # RTLD_NOLOAD | RTLD_NOW: only libraries already loaded
        torch_cuda = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"),
                                 mode=rtld_noload)
        ours = ctypes.CDLL(lib.origin, mode=rtld_noload)
        if (ctypes.cast(torch_cuda.ncclCommRevoke, ctypes.c_void_p).value
                != ctypes.cast(ours.ncclCommRevoke, ctypes.c_void_p).value):
            raise RuntimeError(f"torch's NCCL is not {lib.origin}")
    except (ImportError, OSError, AttributeError, RuntimeError) as exc:
        log.info("NCCL groups are aborted without a revoke first: %s", exc)
        return None
    return lib


def nccl_backend(group: Any) -> Any | None:
    """``group``'s NCCL backend (``ProcessGroupNCCL``), or None when its CUDA backend is not
    NCCL."""
    backend = backend_of(group, torch.device("cuda"))
    if dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL):
        return backend
    return None


def nccl_groups() -> list[Any]:
    """Every registered process group whose CUDA backend is NCCL (the default group and the
    groups made from it: a device mesh's dimensions, new_group's)."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized() or not dist.is_nccl_available():
        return []
    return [pg for pg in list(distributed_c10d._world.pg_names) if nccl_backend(pg) is not None]


def with_nccl_groups(group: Any, nccl: Sequence[Any] | None = None) -> list[Any]:
    """``group`` first, then every other NCCL group (what an abort after a lost rank ends);
    ``nccl``: :func:`nccl_groups`'s list, if the caller has it."""
    return [group, *[g for g in (nccl_groups() if nccl is None else nccl) if g is not group]]


def backend_of(pg: Any, device: torch.device) -> Any | None:
    """``pg``'s backend for ``device`` (None if it has none), unwrapped from the checking
    wrapper that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` puts around it."""
    try:
        return _unwrapped(pg._get_backend(device))
    except (AttributeError, RuntimeError, ValueError):
        return None


def _unwrapped(backend: Any) -> Any:
    wrapper = getattr(dist.distributed_c10d, "_ProcessGroupWrapper", None)
    return backend.wrapped_pg if wrapper is not None and isinstance(backend, wrapper) else backend


def abort_groups(groups: Sequence[Any], timeout_s: float = 30.0) -> bool:
    """Aborts `groups`: the first on this thread, the others at the same time on threads of
    their own (each NCCL abort joins its communicator's proxy thread, which can take 0.5 s),
    waited for up to ``timeout_s`` after the first returned. Errors are ignored (a backend
    without abort: its destruction still releases it).

    Returns:
        False when an abort was still running at the timeout (it goes on, on its thread).
    """
    threads = [threading.Thread(target=_abort_one, args=(g,), daemon=True,
                                name="resilient-abort") for g in groups[1:]]
    for t in threads:
        t.start()
    if groups:
        _abort_one(groups[0])
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        log.warning("an NCCL abort is still running after %.0f s; going on without it",
                    timeout_s)
        return False
    return True


def _abort_one(pg: Any) -> None:
    """``pg.abort()``, and its NCCL backend's when a TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper (whose
    own abort does nothing) stands between. Errors are ignored."""
    try:
        pg.abort()
    except (RuntimeError, NotImplementedError):
        pass
    try:
        raw = pg._get_backend(torch.device("cuda"))
    except (AttributeError, RuntimeError, ValueError):
        return
    inner = _unwrapped(raw)
    if inner is not raw:
        try:
            inner.abort()
        except (RuntimeError, NotImplementedError):
            pass


def abort_revoked() -> None:
    """Starts the abort of every group revoked but not yet aborted (a recovery that stopped
    before its rebuild): a revoked communicator must be aborted, never finalized."""
    with _ABORTS_LOCK:
        left = [g for key, (g, _) in _REVOKES.items() if key not in _ABORTS]
    start_aborts(left)


def wait_for_revoke(group: Any, timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` for a revoke of ``group`` on another thread to return (True
    when none is running); before a shrink, which frees what the revoke still uses."""
    with _ABORTS_LOCK:
        entry = _REVOKES.get(id(group))
    return entry is None or entry[1].wait(timeout_s)


def release_retired_groups(*, expired_only: bool = False) -> int:
    """Drops the references to groups retired by :func:`abort_process_group` and
    :func:`rebuild_process_group`, and forgets finished aborts and revokes. ``expired_only``:
    only the groups whose own collective timeout has passed since they were retired (their
    stuck collectives have returned); Recovery calls this at every step boundary, so the
    registries do not grow with each recovery. The last references are dropped on a thread of
    their own: a backend's destructor that still waits never stalls the caller.

    Returns:
        how many groups were released.
    """
    if not (_RETIRED or _ABORTS or _REVOKES):  # the common case, every step: no lock taken
        return 0
    now = time.monotonic()
    with _RETIRED_LOCK:
        drop = [g for t, g in _RETIRED if not expired_only or t <= now]
        _RETIRED[:] = [(t, g) for t, g in _RETIRED if expired_only and t > now]
    released = len(drop)
    with _ABORTS_LOCK:  # finished aborts, and finished revokes (with expired_only, only those
        # of groups whose abort finished: a revoked group not yet aborted stays, for
        # abort_revoked)
        finished = [key for key, (_, t) in _ABORTS.items() if not t.is_alive()]
        for key in finished:
            drop.append(_ABORTS.pop(key)[0])
        for key, (_, done) in list(_REVOKES.items()):
            if done.is_set() and (not expired_only or key in finished):
                drop.append(_REVOKES.pop(key)[0])
    if drop:
        threading.Thread(target=_drop, args=(drop,), daemon=True,
                         name="resilient-release").start()
        del drop
    return released


def _drop(groups: list[Any]) -> None:
    groups.clear()  # the last references: any destructor runs on this thread


def join_process_group(
    store: Any,
    *,
    generation: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta = timedelta(seconds=60),
    device_id: torch.device | None = None,
    lazy: bool = False,
) -> Any:
    """Creates the default group of ``generation`` (a spare or restarted rank joining, or a
    survivor of a reinit). Blocks until all ``world_size`` ranks joined or ``timeout``.

    ``lazy`` (gloo): no connection is made here; each pair of ranks connects at the first
    collective between them (:func:`gloo_lazy_init`), so a peer lost meanwhile is met by a
    collective that the caller can poll and abandon, not by this call.

    Returns:
        the new default ProcessGroup.
    """
    kwargs: dict[str, Any] = {}
    if device_id is not None:
        kwargs["device_id"] = device_id
    if backend == "nccl":
        prepare_nccl_env()
    _reset_group_names()
    forget_device_meshes()
    if lazy:  # the group's lazy connections wait on a store connection of their own
        from resilient.detect import own_connection

        store = own_connection(store)
    with gloo_lazy_init(lazy):
        dist.init_process_group(
            backend,
            store=generation_store(store, generation),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **kwargs,
        )
    if "nccl" in backend:
        name_default_group_ranks(dist.group.WORLD, world_size)
    return dist.group.WORLD


_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"  # read by torch each time it creates a gloo device
_LAZY_LOCK = threading.Lock()


@contextlib.contextmanager
def gloo_lazy_init(lazy: bool = True) -> Iterator[None]:
    """Within the block, the gloo groups this process creates connect lazily: the group's
    creation returns without waiting for any peer, and each pair of ranks connects (looking up
    its peer's address in the group's store, then TCP) at the first collective between them,
    on the backend's worker thread. Gloo's eager full-mesh connection cannot be interrupted:
    a peer lost after it checked in for the group left every other member blocked in the
    group's creation until its timeout. Lazily, that wait is inside a collective, which the
    caller polls (and abandons on a verdict; the group then goes to the graveyard)."""
    if not lazy:
        yield
        return
    with _LAZY_LOCK:
        before = os.environ.get(_LAZY_ENV)
        os.environ[_LAZY_ENV] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(_LAZY_ENV, None)
            else:
                os.environ[_LAZY_ENV] = before


def name_default_group_ranks(group: Any, world_size: int) -> None:
    """Gives a default NCCL group made after the process's first group its global ranks.

    torch 2.11 leaves a default group's ``global_ranks_in_group`` empty and fills it in
    (``groupRanks()``) only for the process's first group. Splitting any later default group
    (``new_group``, ``init_device_mesh`` with two dimensions: HSDP after a rebuild) then reads
    past that empty list: SIGSEGV in ``ProcessGroupNCCL::split`` (4 H200s, benchmarks/RESULTS.md).
    """
    backend = backend_of(group, torch.device("cuda"))
    options = getattr(backend, "options", None)
    if options is not None and not list(options.global_ranks_in_group):
        options.global_ranks_in_group = list(range(world_size))


def forget_device_meshes() -> None:
    """Clears DTensor's sharding-propagation caches (C++ and Python). They are keyed by specs
    whose meshes compare equal by layout alone, so after a rebuild that keeps the mesh's shape
    (a spare took a lost rank's place) a DTensor operation on the new group's tensors would be
    answered with the old group's mesh: its coordinate (the process's old rank) and its groups.
    FSDP2's parameters are made by such an operation."""
    import sys

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    api = sys.modules.get("torch.distributed.tensor._api")
    prop = getattr(getattr(getattr(api, "DTensor", None), "_op_dispatcher", None),
                   "sharding_propagator", None)
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cached = getattr(prop, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    # the redistribution planner's caches are keyed by meshes too
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    planner = getattr(redistribute, "clear_redistribute_planner_cache", None)
    if planner is not None:
        planner()
    infos = getattr(redistribute, "_gen_transform_infos", None)
    if hasattr(infos, "cache_clear"):
        infos.cache_clear()


def _reset_group_names() -> None:
    """Names this process's next default group "0", as every joiner's is.

    torch names a default group by a per-process counter (its store keys are
    ``<name>/...``) and resets the counter only when a default group is destroyed. An
    init_process_group that failed (a rendezvous that timed out because a peer died or is late)
    still counted: the survivors of that attempt would name the next generation's group "1" and
    wait on keys that ranks joining that generation directly never write (seen in CI: ranks 0-1
    on ``gen2000/1/...``, ranks 2-3 on ``gen2000/0/...``, neither rebuild completed). The
    generation prefix keeps generations apart; the name inside one must not depend on how many
    attempts this process made.
    """
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def verify_group(group: Any | None = None, device: torch.device | str = "cpu") -> float:
    """All-reduces a one on ``group`` and checks the sum equals its size: the first collective
    on a rebuilt group. Returns the seconds it took.

    Raises:
        RuntimeError: the sum is wrong (a rank is in the wrong group) or the collective failed.
    """
    group = group if group is not None else dist.group.WORLD
    t0 = time.monotonic()
    x = torch.ones(1, device=device)
    dist.all_reduce(x, group=group)
    if device != "cpu" and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    size = dist.get_world_size(group)
    if int(x.item()) != size:
        raise RuntimeError(f"verify_group: all_reduce gave {x.item()}, expected {size}")
    return time.monotonic() - t0


def rebuild_process_group(
    store: Any | None,
    *,
    generation: int,
    excluded: Sequence[int],
    backend: str | None = None,
    new_size: int | None = None,
    timeout: timedelta = timedelta(seconds=60),
    prefer_shrink: bool = False,
    device_id: torch.device | None = None,
    verify: bool = True,
) -> RebuildResult:
    """Rebuilds the default process group without the ``excluded`` ranks.

    Every survivor calls this with the same ``generation``, ``excluded`` and ``new_size``.

    Args:
        store: the job's base store (one that outlives any rank, e.g. hosted by the launcher).
            None takes the failed group's store, which only works if its host is alive.
        generation: the new generation; must differ from every earlier one.
        excluded: ranks of the failed group that left.
        backend: backend of the new group for the reinit path (default: the failed group's).
        new_size: world size of the new group when spares join (default: the survivors);
            joiners force the reinit path.
        timeout: the new group's collective and rendezvous timeout.
        prefer_shrink: use ``shrink_group`` where the backend supports it. Off by default:
            torch 2.11's shrink destroys the old group, which hangs while a peer is frozen
            (SIGSTOP, partition); abort + a new group never waits on peers.
        device_id: passed to ``init_process_group`` (binds NCCL groups to a device).
        verify: run :func:`verify_group` as the first collective and time it.

    Returns:
        the new group, this rank and size in it, and the phase timings.

    Raises:
        ValueError: bad ``excluded`` (see :func:`survivor_rank`) or ``new_size``.
        RuntimeError: the torch backend failed (e.g. another rank died during the rebuild);
            the caller retries with more exclusions and a newer generation.
    """
    if not dist.is_initialized():
        raise RuntimeError("rebuild_process_group: no default process group to rebuild")
    old = dist.group.WORLD
    old_rank, old_size = dist.get_rank(), dist.get_world_size()
    rank = survivor_rank(old_rank, old_size, excluded)
    survivors = old_size - len(excluded)
    size = survivors if new_size is None else new_size
    if size < survivors:
        raise ValueError(f"new_size {size} is smaller than the {survivors} survivors")
    backend = backend or dist.get_backend(old)
    timings = RebuildTimings()
    device = "cpu"
    if device_id is not None:
        device = device_id
    elif backend == "nccl" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())

    if prefer_shrink and size == survivors and supports_shrink(old):
        retire_groups([old])
        timings.method = "shrink"
        t0 = time.monotonic()
        group = dist.shrink_group(sorted(excluded), old, shrink_flags=shrink_abort_flag())
        forget_device_meshes()
        timings.rebuild_s = time.monotonic() - t0
    else:
        timings.method = "reinit"
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        timings.abort_s = abort_process_group()
        t0 = time.monotonic()
        group = join_process_group(
            store,
            generation=generation,
            rank=rank,
            world_size=size,
            backend=backend,
            timeout=timeout,
            device_id=device_id,
        )
        timings.rebuild_s = time.monotonic() - t0
    if verify:
        timings.first_collective_s = verify_group(group, device)
    return RebuildResult(group, dist.get_rank(group), dist.get_world_size(group), generation,
                         timings)


def rewrap_ddp(model: torch.nn.Module, process_group: Any, **ddp_kwargs: Any) -> Any:
    """Wraps ``model`` (or the module inside a DistributedDataParallel) in a new DDP on
    ``process_group``. DDP's constructor broadcasts rank 0's parameters and buffers, so the new
    group starts in sync. For a CUDA module ``device_ids`` defaults to the module's device.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = model.module if isinstance(model, DDP) else model
    if "device_ids" not in ddp_kwargs:
        param = next(module.parameters(), None)
        if param is not None and param.device.type == "cuda":
            ddp_kwargs["device_ids"] = [param.device.index]
    return DDP(module, process_group=process_group, **ddp_kwargs)
