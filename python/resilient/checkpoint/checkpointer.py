"""One checkpointer for any world size: sharded, asynchronous saves and strict loads.

Saving. Every rank calls ``save(step, state, rank_state)`` together (one process is the case of
one rank). ``state`` is what data-parallel replicas hold in common (model, optimizer,
scheduler); its tensors may be slices of global tensors (Megatron-style tensor parallelism,
described by ShardSpec). ``rank_state`` is private to the rank (RNG streams, sampler position).
One small all-gather lets every rank compute the same write plan (plan.plan_writes): each
distinct piece of replicated state is written once in total, spread over the ranks that hold
it, and every rank's fingerprint of each replicated tensor is compared, so state that differs
between ranks is refused instead of being stitched together. Each rank snapshots its pieces and
returns; its native engine writes its own shard into root/.tmp-step-N/ in the background.

Committing (a background thread per rank, in save order): wait for the local shard to be
durable and report "ok" or the error under a key of the job's store. Rank 0 waits for every
report, writes the lineage record (root.py), then the native commit_shards() validates the rank
manifests (all from this save: the save id) and commits one global manifest with the
crash-consistent protocol of commit.cpp; then retention. Rank 0 publishes the outcome; every
rank's handle.wait() returns or raises it, and the next save() raises it too. Any failure or
timeout on any rank means no commit: the previous checkpoint is untouched.

Loading (the contract of docs/STATE.md, implemented in contract.py). Rank 0 lists the current
lineage; for each candidate step, newest first: every rank parses the manifest and plans its
load against its live state without modifying it (plan phase); the ranks agree; only if every
rank's plan fits (or strict=False) does every rank read exactly the saved pieces that overlap
the tensors it holds (plan.plan_reads), and the ranks agree again; then each rank puts values in
place and calls load_state_dict() on Stateful objects. A step that fails verification on any
rank is skipped by all of them; a state that does not fit raises IncompatibleCheckpointError on
every rank, with the target unchanged.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import operator
import os
import queue
import re
import shutil
import threading
import time
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Callable

import orjson
import torch

from resilient import _C, _follow_store_setting, settings
from resilient.checkpoint import codec, contract, views
from resilient.checkpoint import root as roots
from resilient.checkpoint.dtensor import is_dtensor, local_chunk, local_chunk_info
from resilient.checkpoint.plan import (
    Held,
    Saved,
    ShardSpec,
    piece_name,
    plan_writes,
    split_piece_name,
)
from resilient.checkpoint.ranks import Ranks, wait_key
from resilient.checkpoint.reader import Reader
from resilient.checkpoint.tiers import (
    Drainer,
    FileTier,
    fetch_into_root,
    make_tier,
    newer_in_tiers,
)
from resilient.checkpoint.tiers import close_timeout as tiers_close_timeout
from resilient.errors import (
    CheckpointCommitError,
    CheckpointNotFoundError,
    CollectiveError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ReplicaMismatchError,
    ResilientError,
    RootInUseError,
    VersionMismatchError,
    commit_error,
)

log = logging.getLogger("resilient.checkpoint")

FORMAT = "resilient.sharded/1"
RANK_FORMAT = "resilient.sharded-rank/1"
MAX_STEP = 2**63 - 1  # step-<12 or more digits>: the whole int64 range
_POLL_S = 0.2  # waits are sliced so that Ctrl-C (KeyboardInterrupt) gets through
# What makes load() skip a step for its parent: bytes that failed verification, a format this
# build cannot read, a missing file. Any other error (EIO, ESTALE, a timeout) may be passing and
# is raised: skipping a good step would make the next save branch off its parent and
# retention delete it.
_SKIPPABLE = (CorruptCheckpointError, VersionMismatchError, FileNotFoundError)


class SaveHandle:
    """A save in flight. ``wait()`` returns once the checkpoint is committed and durable."""

    def __init__(self, step: int, native: Any, save_id: str, keep: list | None,
                 started: float | None = None):
        self.step = step
        self.save_id = save_id
        self._native = native
        self._keep = keep  # the saved tensors, alive until the snapshot stops reading them
        self._event = threading.Event()
        self._retained = threading.Event()  # set once the commit thread is done with it
        self._error: BaseException | None = None
        self._observed = False  # the error was raised to the caller
        self._started = time.monotonic() if started is None else started  # the save() call
        self._committed_s: float | None = None
        self._phases = {"prepare_s": 0.0, "collective_s": 0.0, "submit_s": 0.0}  # save()'s
        self._local_error: BaseException | None = None
        self._owner: Any = None

    def done(self) -> bool:
        """True once the save finished (committed or failed)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until committed; raises CheckpointCommitError (the same on every rank; an
        OSError with errno for an I/O error: errors.CheckpointCommitError), or TimeoutError
        when `timeout` passes first. Interruptible (Ctrl-C); the save goes on in the
        background."""
        if not _wait_event(self._event, timeout):
            raise TimeoutError(f"save of step {self.step} not committed within {timeout} s")
        if self._error is not None:
            self._observed = True
            raise self._error

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Blocks until the snapshot no longer reads the saved tensors; after that they may
        change. Immediate for host tensors and for saves in "blocking" mode."""
        _wait_native(self._native.wait_snapshot, timeout, self._native.done)
        self._keep = None

    def stats(self) -> dict[str, float]:
        """Seconds from the save call: snapshot_s, written_s, durable_s (committed, once
        done); bytes and stored_bytes of this rank's shard. Where the call itself went, in
        seconds, after waiting for a previous overlapped snapshot: prepare_s (reading and
        fingerprinting the state), collective_s (its entry and gathers, waiting for the other
        ranks included) and submit_s (planning, describing the tensors and queueing the
        snapshot, of which issue_s queued the copies; in blocking mode also the wait for
        them)."""
        s = dict(self._native.stats())
        s.update(self._phases)
        if self._committed_s is not None:
            s["durable_s"] = self._committed_s
        return s

    local_stats = stats

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        if error is None:
            self._committed_s = time.monotonic() - self._started
        self._event.set()


@dataclass
class _LoadArgs:
    """How load() matches: strict, world_change and subset as load() documents them."""

    strict: bool
    world_change: str
    subset: bool


@dataclass
class LoadReport:
    """What the last load() did: the step restored, the newer steps skipped (with why), and,
    for strict=False, what was left as it was (paths in the state)."""

    step: int | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    bytes_read: int = 0  #: read from storage by all ranks together (the step loaded)
    #: this rank's seconds per phase of the load: find (which steps to try), prepare (reading
    #: the manifest and planning, until every rank's plan is agreed), the reads (one "read"; for
    #: a shared restore its own phases: through a host buffer plan, read (the host's reads,
    #: with this rank's copies out of the buffer beside them), wait_reads, exchange,
    #: wait_exchange, copy (the pieces other hosts read), or in an NCCL job read_own,
    #: wait_reads, read, broadcast, wait_broadcast), agree_reads (until every rank's reads are
    #: known to have succeeded) and finish (putting values in place, agreed); the step loaded
    #: only, not the steps skipped before it
    seconds: dict[str, float] = field(default_factory=dict)


def tensor_descriptor(
    name: str, t: torch.Tensor, keep: list[torch.Tensor], streams: dict | None = None
) -> dict[str, Any]:
    """The buffer descriptor the native engine reads: pointer, bytes, dtype, shape, device.

    Called once per tensor inside save(), so the common case (a dense, contiguous CPU or CUDA
    tensor) takes as few calls into torch as possible.
    """
    cuda = t.is_cuda
    if not (cuda or t.is_cpu) or t.layout is not torch.strided:
        why = contract.unwritable(t) or f"{t.layout} tensors on {t.device}"
        raise TypeError(f"tensor {name!r} cannot be saved: it is {why}")
    if type(t) is not torch.Tensor and is_dtensor(t):
        raise TypeError(f"tensor {name!r}: a DTensor reaches the engine as its local chunk")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    keep.append(t)
    dtype = t.dtype
    dname = _DTYPE_NAMES.get(dtype)
    if dname is None:
        dname = _DTYPE_NAMES[dtype] = codec.dtype_name(dtype)
    desc = {"name": name, "dtype": dname, "shape": t.shape, "ptr": t.data_ptr(),
            "nbytes": t.nbytes, "device": -1}
    if cuda:
        # The engine copies on its own stream, ordered after the stream that produced the tensor;
        # `keep` holds a reference so the caching allocator cannot reuse the memory meanwhile.
        index = t.get_device()
        desc["device"] = index
        streams = {} if streams is None else streams  # one lookup per device and save
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.current_stream(index).cuda_stream
        desc["stream"] = stream
    return desc


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _plan_descriptors(plan: list, last: list, tensors: dict[str, torch.Tensor],
                      keep: list[torch.Tensor], streams: dict) -> tuple[list[dict[str, Any]], bool]:
    """The descriptors of a save's pieces (`plan`), reusing a piece's descriptor from the last
    save of the same plan (`last`, updated in place) when the tensor is laid out as then; and
    whether every descriptor was reused (then the native copy of the last ones still holds,
    streams aside: `streams` maps each CUDA device to the stream looked up in this save).

    The plan's key covers each tensor's name, shape and dtype, so a descriptor still holds when
    the tensor has the same data pointer and device and is contiguous without a conjugate or
    negative bit (a view such as x.conj() or a transpose shares the pointer). The CUDA streams
    are looked up again on every save, once per device. Rebuilding every descriptor costs
    milliseconds per save for a thousand tensors, a sizeable part of an overlapped save's
    return.
    """
    descs = []
    reused = True
    for i, (piece, entry, global_shape, offset) in enumerate(plan):
        t = tensors[piece.name]
        d = last[i]
        if (d is not None and piece.rows is None and t.data_ptr() == d["ptr"]
                and t.get_device() == d["device"] and t.is_contiguous()
                and not t.is_conj() and not t.is_neg()):
            keep.append(t)
            device = d["device"]  # its "stream" may be stale: save_specs sets each
            if device >= 0 and device not in streams:  # device's stream from `streams`
                streams[device] = torch.cuda.current_stream(device).cuda_stream
        else:
            if piece.rows is not None:
                t = t.detach()[piece.rows[0] : piece.rows[1]]
            d = tensor_descriptor(entry, t, keep, streams)
            d["global_shape"], d["global_offset"] = global_shape, offset
            last[i] = d
            reused = False
        descs.append(d)
    return descs, reused


def _local_held(tensors: dict[str, Any], held_of: Callable[..., Held],
                meshes: dict[int, Any] | None = None,
                last: dict[str, tuple] | None = None) -> tuple[list[Held], set[str], dict]:
    """One pass over a save's tensors: replaces each DTensor by its local chunk (in place),
    refuses what the engine cannot write (before the save's collectives, so that one rank's
    refusal cannot leave the others inside them), and describes each tensor with `held_of(name,
    tensor, chunk place or None)`. Returns the Held list, the names of the DTensor chunks no
    other rank holds (no Replicate placement: FSDP), which need no replica check, and what the
    next save's pass may reuse (pass it as `last`); `meshes` collects the DTensors' device
    meshes.

    Reuse: a DTensor that is the same object as in the last save, with the same local tensor
    and placement spec objects, and whose local tensor still has the shape and dtype it had
    then, on a CPU or CUDA device, strided, has the same chunk, place and Held: that skips
    microseconds per DTensor per save. Weak references only: a save must not keep a dropped
    model's memory alive."""
    held, alone, now = [], set(), {}
    last = last or {}
    last_mesh = None
    for name, t in tensors.items():
        c = last.get(name)  # only DTensors have an entry: the same object is one still
        if c is None or c[0]() is not t:
            if type(t) is torch.Tensor or not is_dtensor(t):
                _check_savable(name, t)
                held.append(held_of(name, t, None))
                continue
            c = None
        local = getattr(t, "_local_tensor", None)
        if (c is not None and local is not None and c[1]() is local
                and t._spec is c[2]
                and local.shape == c[3] and local.dtype is c[4]
                and local.layout is torch.strided and (local.is_cuda or local.is_cpu)):
            now[name] = c
        else:
            try:
                local, place, replicated = local_chunk_info(t)
            except ValueError as e:
                raise TypeError(f"tensor {name!r} cannot be saved: it is {e}") from None
            _check_savable(name, local)
            c = (weakref.ref(t), weakref.ref(local), getattr(t, "_spec", None), local.shape,
                 local.dtype, held_of(name, local, place), not replicated)
            if c[2] is not None and local is getattr(t, "_local_tensor", None):  # not a copy
                now[name] = c
        tensors[name] = local
        held.append(c[5])
        if c[6]:
            alone.add(name)
        if meshes is not None:
            mesh = t.device_mesh
            if mesh is not last_mesh:
                meshes[id(mesh)] = last_mesh = mesh
    return held, alone, now


def _one_process_job() -> bool:
    """Whether nothing says this process is one of several of a job (a launcher's environment,
    an initialized process group of several ranks)."""
    env = os.environ
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(key, "1").strip() not in ("", "1"):
            return False
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _may_write_now(world_size: int) -> bool:
    """Whether this process can be the root's writer now (see Checkpointer's `writer`)."""
    if os.environ.get("RESILIENT_JOIN") == "1":  # recovery.environment.JOIN_ENV
        return False
    dist = torch.distributed
    if world_size == 1 and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    if world_size == 1 and os.environ.get("RANK", "0").strip() not in ("", "0"):
        return False
    return True


def _mark_target(e: BaseException, touched: bool) -> None:
    """Says on an error raised by load() whether the target was partly overwritten."""
    try:
        e.target_modified = touched  # type: ignore[attr-defined]
    except AttributeError:
        return
    if touched and hasattr(e, "add_note"):
        e.add_note("resilient: this failed load already wrote part of a checkpoint into the "
                   "target state (target_modified=True): it is neither the state it was nor a "
                   "checkpoint's. Load again, or rebuild the model and optimizer, before "
                   "training.")


def _optimizers_in(state: Any, depth: int = 0) -> list[torch.optim.Optimizer]:
    """The torch optimizers in a state (containers walked; a few levels deep)."""
    if isinstance(state, torch.optim.Optimizer):
        return [state]
    if depth > 4:
        return []
    if isinstance(state, dict):
        items: Any = state.values()
    elif isinstance(state, (list, tuple)):
        items = state
    else:
        return []
    return [o for x in items for o in _optimizers_in(x, depth + 1)]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Garbage collection off for a stretch of a save's Python work on the caller's thread:
    its few thousand short-lived objects are collected at the training step's next
    allocations (a millisecond or so of gen-0/1 passes) rather than inside the call training
    waits for. Never around a wait (a collective, a device copy): other threads keep their
    collection."""
    collecting = gc.isenabled()
    if collecting:
        gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _values_json(values: dict[str, Any]) -> bytes:
    """A save's values as JSON. orjson first: the state's document is ~100 KB for a
    1,000-tensor model, which the standard encoder takes milliseconds for (the codec tags
    non-finite floats, so orjson's NaN-as-null never applies). What orjson refuses and the
    standard encoder writes (str and float subclasses, nesting deeper than 255) goes to the
    latter: this runs after the save's collectives, where one rank must not fail alone."""
    try:
        return orjson.dumps(values)
    except TypeError:  # orjson.JSONEncodeError included
        return json.dumps(values, allow_nan=False).encode()


def _mesh_records(meshes: Any) -> list[dict[str, Any]]:
    """The distinct device meshes of a save's DTensors: device type, shape, dimension names."""
    out = []
    for mesh in meshes:
        names = getattr(mesh, "mesh_dim_names", None)
        rec = {"device_type": str(mesh.device_type), "shape": [int(x) for x in mesh.shape],
               "dim_names": list(names) if names else None}
        if rec not in out:
            out.append(rec)
    return out


def _stored_pieces(pieces: list, held: list[Held]) -> list[tuple]:
    """For each piece this rank writes: the piece, its stored name, global shape and offset."""
    by_name = {h.name: h for h in held}
    out = []
    for piece in pieces:
        h = by_name[piece.name]
        offset = h.offset
        if piece.rows is not None:
            offset = (h.offset[0] + piece.rows[0], *h.offset[1:])
        out.append((piece, "S/" + piece_name(piece.name, offset), list(h.global_shape),
                    list(offset)))
    return out


def _check_savable(name: str, t: torch.Tensor) -> None:
    """Raises TypeError for a tensor tensor_descriptor() would refuse (checked before a save's
    collectives, so that one rank's refusal cannot leave the others inside them). DTensors
    arrive here as their local chunks."""
    if type(t) is not torch.Tensor and is_dtensor(t):  # only rank_state still holds them
        raise TypeError(f"tensor {name!r} cannot be saved: a DTensor in rank_state (per-rank "
                        "state holds local tensors; sharded state belongs in the state)")
    if not (t.is_cuda or t.is_cpu) or t.layout is not torch.strided:
        why = contract.unwritable(t) or f"{t.layout} tensors on {t.device}"
        raise TypeError(f"tensor {name!r} cannot be saved: it is {why}")


_OPEN: weakref.WeakSet = weakref.WeakSet()


class Checkpointer:
    """Saves and restores training state under ``root``, for one process or every rank of a
    torch.distributed job (then every call is collective). See docs/STATE.md for what a load
    guarantees.

    Args:
        root: checkpoint directory (the same path, on a shared file system, on every rank).
        keep: committed checkpoints of the current lineage kept (<= 0: all).
        create: the run may start fresh: create the root now if it does not exist, and let
            load() return None for a root with no committed step. Without it, load() raises
            CheckpointNotFoundError for a missing root (a mistyped path); the first save still
            creates it. "created a new checkpoint root at ..." is logged at info, and a warning
            when directories above it had to be created too.
        writer: this checkpointer saves: take the root's writer lock now (RootInUseError at
            once while another job writes there, before this one resumes from that job's live
            step) rather than at the first save. Default: with create=True in a one-process
            job (not under torchrun, srun or an initialized process group of several ranks);
            CheckpointManager always. Never in a process that cannot be the job's writer yet:
            a spare or a replacement waiting to join (RESILIENT_JOIN=1), or a rank other than 0
            of a torch.distributed job holding a checkpointer of its own (distributed=False).
            False: only at the first save.
        takeover: for in-process recovery after a rank was lost (CheckpointManager.regroup):
            when the root's writer lock is held by a process of this job that is not in the new
            group (the removed writer, still alive: frozen, cut off), write anyway and take the
            lock once that process is gone (root.WriterLock). Another job's lock is never
            taken over.
        distributed: None (default): every rank of the default process group takes part when
            torch.distributed is initialized with more than one rank; False: this process alone
            (a rank-0-only checkpoint); True: require a process group.
        specs: ShardSpec per tensor name of `state` ("model/fc1.weight"); a key ending in "/*"
            applies to tensors below it whose shape matches (optimizer state of a sharded param).
        group: a gloo process group over all ranks for planning; default: a new one.
        store: a torch.distributed Store shared by all ranks; default: the default group's.
        timeout: seconds a save may take from snapshot to commit, any single blocking step
            of the engine, and each wait of a collective load for the others' reads and
            transfers (a peer frozen or lost mid-load makes every rank raise CollectiveError
            after it, or at once when in-process recovery's verdict aborts the load; default
            600, RESILIENT_DIST_TIMEOUT_S / RESILIENT_CKPT_TIMEOUT_S).
        collective_timeout: seconds every rank has to enter a save or load (default 30,
            RESILIENT_COLLECTIVE_TIMEOUT_S).
        split_bytes: replicated tensors at least this large are split by rows across replicas
            (default 1 MiB, RESILIENT_DIST_SPLIT_BYTES).
        check_replicas: compare every rank's fingerprint of each replicated tensor at each save
            (default on, RESILIENT_CHECK_REPLICAS=0 turns it off).
        restore: "shared" (default, RESILIENT_DIST_RESTORE): each piece that several ranks of
            a host need is read from storage once per host, into a /dev/shm buffer the host's
            ranks share, split over them; a piece every host needs, once in all, each rank
            sending what it read to a rank of every other host (RESILIENT_HOST_ID); in an NCCL
            job with GPU targets, a piece every rank needs is read once into one rank's GPU and
            broadcast; a piece one rank needs is read straight into its target
            (Reader.run_shared; without a usable /dev/shm every rank reads directly, with a
            warning); "direct": every rank reads the pieces it
            needs from the shared directory; "redistribute": rank r reads the shards of saved
            ranks s with s % world == r and broadcasts them over the gloo group.
        tiers: slower tiers that rank 0 copies each committed step to in the background, in
            order (paths, "s3://bucket/prefix" URLs, or FileTier/S3Tier objects with their own
            keep; default RESILIENT_TIERS). The root is then the fast tier (node-local NVMe or
            tmpfs for a one-host job); load() takes a newer or verified copy from a tier when
            the root lacks one. See docs/io.md, "Tiers".
        options: engine options (zstd_level, chunk_bytes, pool_bytes, io_uring, o_direct,
            pin_memory, queue_depth, request_bytes ...: docs/SETTINGS.md).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep: int = 3,
        *,
        create: bool = False,
        writer: bool | None = None,
        takeover: bool = False,
        distributed: bool | None = None,
        specs: dict[str, ShardSpec] | None = None,
        group: Any = None,
        store: Any = None,
        timeout: float | None = None,
        collective_timeout: float | None = None,
        split_bytes: int | None = None,
        check_replicas: bool | None = None,
        restore: str | None = None,
        tiers: list[Any] | None = None,
        **options: Any,
    ):
        self.root = os.fspath(root)
        self.keep = int(keep)
        self.specs = types.MappingProxyType(dict(specs or {}))  # fixed: _held caches them
        if timeout is None:
            timeout = settings.get("RESILIENT_DIST_TIMEOUT_S")
        if split_bytes is None:
            split_bytes = settings.get("RESILIENT_DIST_SPLIT_BYTES")
        if check_replicas is None:
            check_replicas = settings.get("RESILIENT_CHECK_REPLICAS")
        self.timeout = float(timeout)
        self.split_bytes = int(split_bytes)
        self.check_replicas = bool(check_replicas)
        self.restore = restore or settings.get("RESILIENT_DIST_RESTORE")
        if self.restore not in ("direct", "redistribute", "shared"):
            raise ValueError("restore must be 'direct', 'redistribute' or 'shared', not "
                             f"{self.restore!r}")
        self.create = bool(create)
        if tiers is None:
            tiers = settings.get("RESILIENT_TIERS") or []
        self._tiers = [make_tier(t, self.keep) for t in tiers]
        for t in self._tiers:
            if isinstance(t, FileTier) and os.path.realpath(t.path) == os.path.realpath(
                    self.root):
                raise ValueError(f"tier {t.path!r} is the checkpoint root itself")
        self._drainer: Drainer | None = None
        self._tier_seq = 0  # the newest commit seq the tiers held at load (commits go after it)
        self._no_tier_wait = False
        self._ranks = Ranks(distributed, group, store, self.timeout, collective_timeout)
        self.rank, self.world_size = self._ranks.rank, self._ranks.world_size
        opts = _C.CheckpointOptions(self.root)
        opts.keep = 0  # retention follows the lineage (roots.apply_retention), on rank 0
        opts.rank, opts.world_size = self.rank, self.world_size
        opts.timeout_s = self.timeout
        for key, value in options.items():
            if value is None:
                continue
            if not hasattr(opts, key):
                raise TypeError(f"unknown checkpoint option {key!r}")
            setattr(opts, key, value)
        self.options = opts
        self._native = _C.Checkpointer(opts)
        self._lock = roots.WriterLock(self.root)
        self._takeover = takeover
        weakref.finalize(self, self._lock.release)
        error = None
        if writer is None:
            writer = self.create and _one_process_job()
        writer = writer and _may_write_now(self.world_size)
        if (self.create or writer) and self.rank == 0:
            # A run that saves takes its writer lock now, so a second job on a root in use
            # stops here, not at its first save after resuming from the other job's live step.
            try:
                created, missing = (roots.ensure_root(self.root) if self.create
                                    else (False, None))
                if writer and roots.is_root(self.root):
                    self._lock.acquire(self._job_token(), takeover=takeover)
                if created:
                    log.info("created a new checkpoint root at %s", os.path.abspath(self.root))
                if missing:
                    log.warning("created a new checkpoint root at %s, and the directory %s "
                                "above it, which did not exist either: is the path mistyped?",
                                os.path.abspath(self.root), missing)
            except RootInUseError as e:
                error = ("in use", str(e))
            except Exception as e:
                error = ("create", f"{type(e).__name__}: {e}")
        error = self._ranks.broadcast(error)
        if error is not None:
            self._lock.release()
            if error[0] == "in use":
                raise RootInUseError(
                    error[1] + " (this checkpointer takes the lock when it is made: "
                    "create=True in a one-process job, or writer=True; a job whose every "
                    "process holds a checkpointer of its own that only one uses to save passes "
                    "writer=False, and the saver takes the lock at its first save)")
            raise CheckpointNotFoundError(f"cannot create checkpoint root: {error[1]}",
                                          self.root)
        self._plan_key: Any = None
        self._key_of: tuple[list, Any, int] = ([], None, 0)  # save(): held, split_bytes, key
        self._plan: list = []  # (piece, stored name, global shape, global offset)
        self._descs: list = []  # per piece of _plan: its last descriptor, or None (reset with it)
        self._specs: Any = None  # _descs converted by the binding (_C.TensorSpecs), or None
        # (name, shape, dtype, id(chunk)) -> (chunk, Held) (specs are fixed)
        self._held_cache: dict[tuple, tuple[ShardSpec | None, Held]] = {}
        self._last_local: dict[str, tuple] = {}  # _local_held's reuse from the last save
        self._root_ready = False  # a save's gather found no rank failing before it
        self._everyone: list = []
        self._raised_ids: set[str] = set()
        self._lock_ids = threading.Lock()  # _raised_ids and _observed: main vs commit thread
        self._save_seq = 0
        self._failed: list[SaveHandle] = []
        self._in_flight: list[SaveHandle] = []
        self._in_snapshot: SaveHandle | None = None
        self._fenced: list[SaveHandle] = []
        self._head: tuple[int, int | None] | None = None  # rank 0: parent of the next commit
        self._max_seq: int | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        # The thread holds no reference to the checkpointer while idle (a handle in flight
        # does), so one that is dropped unclosed is collected and its thread ends.
        self._thread = threading.Thread(target=_commit_loop, args=(self._queue,),
                                        name="resilient-commit", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)
        # Freeing deleted steps' space (unlinking large files) runs on a thread of its own, so
        # neither the next commit nor a load waits for it.
        self._purge: queue.Queue[Any] = queue.Queue()
        self._purger = threading.Thread(target=_purge_loop, args=(self._purge,),
                                        name="resilient-purge", daemon=True)
        self._purger.start()
        weakref.finalize(self, self._purge.put, None)
        self._published: list[str] = []  # rank 0: outcomes not yet known read by every rank
        self._closed = False
        self._created = time.time() - 1.0  # older leftovers are a crashed writer's (mtime slack)
        self._skip_error: BaseException | None = None
        self._dirty: int | None = None  # a skipped step whose failed read wrote into the target
        # (step loaded, [optimizer steps since], hooks): _check_step_number's evidence
        self._after_load: tuple[int, list[int], list[Any]] | None = None
        self._find_s = 0.0  # the load in progress: seconds until the steps to try were known
        self._touched = False  # the load in progress began writing into the target
        self.last_load = LoadReport()
        _OPEN.add(self)

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, state: Any, rank_state: Any = None,
             mode: str = "blocking") -> SaveHandle:
        """Collective. Snapshots this rank's part of `state` (and its `rank_state`) and
        returns; writing and the commit go on in the background.

        mode "blocking": when this returns, the tensors may be modified (for CUDA tensors it
        waits for the device-to-host copies). mode "overlap": returns once the copies are queued
        on the engine's streams; the tensors must not change until ``wait_snapshot()`` (the hook
        of ``attach(optimizer)`` orders the next ``optimizer.step()`` after them).

        Raises the previous save's error if it failed (CheckpointCommitError), TypeError for
        values that cannot be stored without pickle, ReplicaMismatchError when replicated
        tensors differ between ranks, CollectiveError when not every rank calls it.
        """
        started = time.monotonic()
        self._check_open()
        if mode not in ("blocking", "overlap"):
            raise ValueError("mode must be 'blocking' or 'overlap'")
        step = int(step)
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be in [0, {MAX_STEP}], not {step}")
        self.wait_snapshot()  # a previous overlapped snapshot must finish before a new one
        reading = time.monotonic()  # the call's phases (stats()) are counted from here
        # Everything that can fail on one rank alone happens before entering (the others then
        # get CollectiveError) or travels through the gather below (every rank raises).
        meshes: dict[int, Any] = {}
        with _gc_paused():
            enc = views.encode(state, keep_vars=True)  # read only: no detach per parameter
            held, alone, self._last_local = _local_held(
                enc.tensors, self._held, meshes if self.rank == 0 else None, self._last_local)
            _check_positional_specs(self.specs, enc.tensors)
            renc = views.encode(rank_state) if rank_state is not None else None
            for name, t in (renc.tensors.items() if renc else ()):
                _check_savable(name, t)
        # Until a save made the root, every rank's call is compared before rank 0 does.
        entered = time.monotonic()
        prepare_s = entered - reading
        self._ranks.enter("save", step, check=not self._root_ready)
        reading = time.monotonic()
        collective_s = reading - entered
        problem = None
        try:
            self._check_step_number(step)
            if self.rank == 0 and self._lock.fd is None:  # the first save makes the root
                roots.ensure_root(self.root)
                self._lock.acquire(self._job_token(), takeover=self._takeover)  # one writer
            if self.rank == 0 and self._lock.taken_over:
                self._lock.reclaim()  # the removed writer may be gone by now
            if self.rank == 0:
                self._start_drainer()  # once: the copies to the tiers
            prints = (_fingerprints(enc.tensors, alone)
                      if self.check_replicas and self.world_size > 1
                      else None)
        except Exception as e:
            problem, prints = e, None
        last, split, key = self._key_of  # Held are cached: the same list hashes the same
        if (split != self.split_bytes or len(held) != len(last)
                or not all(map(operator.is_, held, last))):
            key = hash((tuple(held), self.split_bytes))
            self._key_of = (held, self.split_bytes, key)
        failed = [h for h in self._failed if not h._observed]
        report = [(h.save_id, _failure_text(h._error), _cause_of(h._error)) for h in failed]
        why = None if problem is None else (type(problem).__name__, f"rank {self.rank}: {problem}")
        entered = time.monotonic()
        prepare_s += entered - reading
        gathered = self._ranks.gather((key, prints, report, why), fit=True)
        submitted = time.monotonic()
        collective_s += submitted - entered
        self._save_seq += 1  # every rank, whatever happens next: save ids stay in step
        with self._lock_ids:
            for h in failed:
                h._observed = True
            self._raised_ids.update(i for g in gathered for i, *_ in g[2])
        if problem is not None:
            raise problem
        whys = [g[3] for g in gathered if g[3] is not None]
        self._root_ready = self._root_ready or not whys  # the same on every rank
        if whys:
            kind = RootInUseError if whys[0][0] == "RootInUseError" else ResilientError
            raise kind(f"step {step} was not saved: {whys[0][1]}")
        reports = sorted({(e, c) for g in gathered for _, e, c in g[2]})
        if reports:
            exc = _commit_failure(f"step {step} was not saved: "
                                  + "; ".join(e for e, _ in reports), reports[0][1])
            ids = {i for g in gathered for i, *_ in g[2]}
            local = [h._local_error for h in failed if h.save_id in ids and h._local_error]
            raise exc from (local[0] if local else None)
        if self._after_load is not None and self._after_load[0] != step:
            self._stop_watching_steps()  # a new step: the loaded one is behind the loop
        keys = [g[0] for g in gathered]
        if keys != self._plan_key:
            entered = time.monotonic()
            everyone = self._ranks.gather(held)
            planning_gather_s = time.monotonic() - entered
            collective_s += planning_gather_s
            submitted += planning_gather_s  # counted once, as collective time
            self._plan = _stored_pieces(plan_writes(everyone, self.rank, self.split_bytes), held)
            self._plan_key = keys
            self._everyone = everyone
            self._descs = [None] * len(self._plan)
            self._specs = None
        if prints is not None:
            _check_replicas(self._everyone, [g[1] for g in gathered])
        keep: list[torch.Tensor] = []
        streams: dict = {}
        with _gc_paused():
            specs, self._specs = self._specs, None  # stale should _plan_descriptors raise midway
            descs, reused = _plan_descriptors(self._plan, self._descs, enc.tensors, keep, streams)
            self._specs = specs if reused and specs is not None else _C.TensorSpecs(descs)
            rank_doc, extra = None, []
            if renc is not None:
                rank_doc = renc.doc
                extra = [tensor_descriptor(f"R{self.rank}/{n}", t, keep, streams)
                         for n, t in renc.tensors.items()]
            save_id = f"{self._ranks.run_id}-{self._save_seq}"
            values = {
                "format": RANK_FORMAT,
                "save_id": save_id,
                "rank": self.rank,
                "world_size": self.world_size,
                "state": enc.doc if self.rank == 0 else None,
                "rank_state": rank_doc,
            }
            if meshes and self.rank == 0:  # what `resilient ckpt ls/show` report as the mesh
                values["meshes"] = _mesh_records(meshes.values())
            values_json = _values_json(values)
        native = self._native.save_specs(step, self._specs, streams, extra, values_json, False,
                                         mode)
        handle = SaveHandle(step, native, save_id, keep if mode == "overlap" else None, started)
        handle._owner = self  # alive until committed, even if the caller drops it
        handle._phases.update(prepare_s=prepare_s, collective_s=collective_s,
                              submit_s=time.monotonic() - submitted)
        if mode == "overlap":
            self._in_snapshot = handle
        self._in_flight = [h for h in self._in_flight if not h.done()] + [handle]
        self._queue.put(handle)
        return handle

    def _held(self, name: str, t: torch.Tensor, chunk: ShardSpec | None = None) -> Held:
        # Keyed by the chunk's identity (hashing a ShardSpec costs a microsecond; a DTensor's
        # chunk is one cached object from save to save), which the entry holds against reuse.
        key = (name, t.shape, t.dtype, id(chunk))
        hit = self._held_cache.get(key)
        if hit is not None and hit[0] is chunk:
            return hit[1]
        if len(self._held_cache) > 1 << 16:
            self._held_cache.clear()
        held = self._describe(name, tuple(t.shape), t, chunk)
        self._held_cache[key] = (chunk, held)
        return held

    def _describe(self, name: str, shape: tuple[int, ...], t: torch.Tensor,
                  chunk: ShardSpec | None) -> Held:
        spec = chunk if chunk is not None else self.spec_for(name, shape, None)
        if spec is not None:
            spec.check(name, shape)
        gshape, offset = (
            (spec.global_shape, spec.offset) if spec else (shape, tuple(0 for _ in shape))
        )
        return Held(name, codec.dtype_name(t.dtype), t.element_size(), shape, tuple(gshape),
                    tuple(offset))

    def spec_for(
        self, name: str, shape: tuple[int, ...] | None, saved_gshape: tuple | None
    ) -> ShardSpec | None:
        """The ShardSpec of tensor `name`: an exact key, else the longest matching "prefix/*" key
        whose spec fits (same local shape, or, with no live tensor, the saved global shape)."""
        spec = self.specs.get(name)
        if spec is not None:
            return spec
        def fits(s: ShardSpec) -> bool:
            return (tuple(s.shape) == shape if shape is not None
                    else tuple(s.global_shape) == saved_gshape)

        best = None
        for pattern, s in self.specs.items():
            if pattern.endswith("*") and fnmatchcase(name, pattern) and fits(s):
                if best is None or len(pattern) > len(best[0]):
                    best = (pattern, s)
        if best is not None:
            return best[1]
        # Optimizer state saved by parameter name ('optim/state/<fqn>/exp_avg') shaped like its
        # parameter inherits the parameter's spec ('model/<fqn>'), when exactly one has it.
        m = _OPTIM_STATE.match(name)
        if m is None or m["param"].isdigit():
            return None
        found = {key: s for key, s in self.specs.items() if not key.endswith("*") and fits(s)
                 and (key == m["param"] or key.endswith("/" + m["param"]))}
        if len({(tuple(s.global_shape), tuple(s.offset)) for s in found.values()}) > 1:
            raise ValueError(
                f"tensor {name!r}: the specs of {sorted(found)} all name its parameter and "
                "differ; give its optimizer state a spec of its own")
        return next(iter(found.values()), None)

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Waits until the last overlapped save no longer reads the saved tensors."""
        handle, self._in_snapshot = self._in_snapshot, None
        if handle is not None:
            handle.wait_snapshot(timeout)

    def fence(self) -> None:
        """Orders the next GPU work after the last overlapped snapshot, without blocking.

        Each CUDA device's current stream waits (on the device) for the snapshot's copies, so
        kernels queued afterwards - the optimizer step - cannot change what is being copied,
        while the host keeps queueing work. The saved tensors stay referenced until the save
        completes. Host-only snapshots need nothing (their copies are done when save returns).
        """
        handle, self._in_snapshot = self._in_snapshot, None
        if handle is None:
            return
        devices = {t.device for t in handle._keep or () if t.device.type == "cuda"}
        for device in devices:
            handle._native.fence_stream(torch.cuda.current_stream(device).cuda_stream)
        self._fenced.append(handle)  # keeps the tensors alive until the copies complete
        self._fenced = [h for h in self._fenced if not h.done()]

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Makes `optimizer.step()` ordered after an overlapped snapshot (``fence()``), so a
        checkpoint taken in "overlap" mode holds exactly the saved step's values, without
        blocking the training thread. Returns the hook handle."""
        return optimizer.register_step_pre_hook(lambda *_: self.fence())

    # -- committing (background thread) --------------------------------------------------
    def _commit_one(self, handle: SaveHandle) -> None:
        handle._local_error = None
        try:
            error = self._commit(handle)
        except Exception as e:  # the store itself failed (a peer or rank 0 is gone)
            error = f"coordination failed: {type(e).__name__}: {e}"
        # Every rank raises the same exception, of the cause's type in every mode (an OSError
        # with errno, a TimeoutError: errors.CheckpointCommitError), chained to its own error.
        exc: BaseException | None = None
        if error is not None:
            if self.world_size == 1:
                error = error.removeprefix("rank 0: ")
            error, cause = _parse_cause(error)
            exc = _commit_failure(f"checkpoint of step {handle.step} was not committed: {error}",
                                  cause)
            exc.__cause__ = handle._local_error
        if exc is not None:
            # Raised by the next call (save, wait, close); logged here at info only, so that
            # it is printed once.
            log.info("%s (the next save(), wait() or close() raises it)", exc)
            with self._lock_ids:
                handle._observed = handle.save_id in self._raised_ids  # raised by save()
                self._failed.append(handle)
        if exc is None and self.rank == 0 and self._drainer is not None:
            self._drainer.offer(handle.step)  # before wait() returns: wait_tiers() then sees it
        handle._finish(exc)
        if exc is None and self.rank == 0:
            self._retain()
        handle._retained.set()

    def _commit(self, handle: SaveHandle) -> str | None:
        store = self._ranks.store
        prefix = f"resilient/ckpt/{handle.save_id}"
        try:
            handle._native.wait(self.timeout)
            report = "ok"
        except Exception as e:
            report = f"error: rank {self.rank}: {_cause_text(e)}"
            handle._local_error = e
        store.set(f"{prefix}/rank{self.rank}", report)
        if self.rank == 0:
            result = self._coordinate(handle, prefix)
            store.set(f"{prefix}/result", result)
            if self.world_size > 1 and result == "ok":  # a failure reads as one anyway
                self._note_published(prefix)
        else:
            # Rank 0 gives every rank `timeout` from its own start, then publishes: wait for
            # that (a rank that gave up earlier could report a failure rank 0 then committed).
            wait_key(store, f"{prefix}/result", 2 * self.timeout + 60, poll_s=0.05,
                     abort=f"{prefix}/abandoned")
            result = store.get(f"{prefix}/result").decode()
            store.add(f"{prefix}/read", 1)  # rank 0's close() waits for every rank's read
        return None if result == "ok" else result.removeprefix("error: ")

    def _note_published(self, prefix: str) -> None:
        """Rank 0: remembers `prefix` until every rank read its outcome (earlier ones that all
        ranks read by now are forgotten: one store call per save)."""
        store = self._ranks.store
        with self._lock_ids:
            earlier = list(self._published)
        pending = []
        for p in earlier:
            try:
                if store.add(f"{p}/read", 0) < self.world_size - 1:
                    pending.append(p)
            except Exception:
                pending.append(p)
        with self._lock_ids:
            self._published = [*pending, prefix]

    def _wait_outcomes_read(self, timeout: float) -> None:
        """Rank 0: waits (bounded) until every rank has read the published outcome of each save,
        so that a rank 0 which also serves the job's store (init_process_group over tcp://)
        and exits right after close() does not take an outcome with it: the others would
        report a committed checkpoint as failed ("coordination failed")."""
        with self._lock_ids:
            published, self._published = self._published, []
        deadline = time.monotonic() + timeout
        store = self._ranks.store
        for prefix in published:
            try:
                while store.add(f"{prefix}/read", 0) < self.world_size - 1:
                    if time.monotonic() >= deadline:
                        log.warning("closing: not every rank read the outcome of %s within "
                                    "%g s (a rank is gone?)", prefix, timeout)
                        return
                    time.sleep(0.01)
            except Exception as e:  # the store is gone: nobody can read it any more
                log.warning("closing: cannot check that every rank read %s: %s", prefix, e)
                return

    def _coordinate(self, handle: SaveHandle, prefix: str) -> str:
        store = self._ranks.store
        errors = []
        deadline = time.monotonic() + self.timeout
        for r in range(self.world_size):
            try:
                wait_key(store, f"{prefix}/rank{r}", max(0.0, deadline - time.monotonic()),
                         poll_s=0.05, abort=f"{prefix}/abandoned")
                report = store.get(f"{prefix}/rank{r}").decode()
            except CollectiveError as e:  # abandon(): the group lost a rank
                report = f"error: abandoned: {e}"
            except Exception as e:
                report = (f"error: rank {r}: TimeoutError: did not report within {self.timeout} s "
                          f"({type(e).__name__})")
            if report != "ok":
                errors.append(report.removeprefix("error: "))
            try:  # keep the job's store small over thousands of saves
                store.delete_key(f"{prefix}/rank{r}")
            except Exception:
                pass
        if errors:
            # Nothing of this save is committed: give its space back (a full disk must not stay
            # full of a failed save's shards).
            shutil.rmtree(roots.tmp_dir(self.root, handle.step), ignore_errors=True)
            return "error: " + "; ".join(errors)
        if store.check([f"{prefix}/abandoned"]):  # a writer woken after its group gave up
            shutil.rmtree(roots.tmp_dir(self.root, handle.step), ignore_errors=True)
            return f"error: abandoned: {store.get(f'{prefix}/abandoned').decode()}"
        try:
            steps = self.steps()
            if self._max_seq is None or self._head is None:
                chain, info = roots.history(self.root, steps)
                self._max_seq = roots.max_seq(info)
                self._max_seq = max(self._max_seq, self._tier_seq)
                if self._head is None and chain:
                    li = info[chain[0]]
                    self._head = (chain[0], li.seq if isinstance(li, roots.Lineage) else None)
            seq = self._max_seq + 1
            parent = self._head
            if parent is not None and handle.step <= parent[0]:  # re-saving: replace the step
                parent = roots.parent_for(roots.history(self.root, steps)[1], parent,
                                          handle.step)
            roots.write_lineage(roots.tmp_dir(self.root, handle.step), handle.step, seq,
                                parent)
            _C.commit_shards(self.root, handle.step, self.world_size, handle.save_id)
        except Exception as e:
            return f"error: commit failed: {type(e).__name__}: {e}"
        self._max_seq, self._head = seq, (handle.step, seq)
        return "ok"

    def _retain(self) -> None:
        """Rank 0, after a commit was reported: deletes what retention no longer keeps (off the
        save's critical path: deleting a large step takes a while)."""
        try:
            protect = self._drainer.protected() if self._drainer is not None else frozenset()
            deleted = roots.apply_retention(self.root, self.steps(), self.keep, protect)
            for path in roots.stale_saves(self.root, self._created):  # crashed saves' leftovers
                name = f".trash-{os.path.basename(path)[5:]}-{os.urandom(4).hex()}"
                os.rename(path, os.path.join(self.root, name))
                deleted.append(path)
            if deleted:
                self._purge.put(self.root)
        except Exception as e:  # a failed cleanup does not undo the commit
            log.warning("checkpoint retention failed: %s", e)

    def wait(self, timeout: float | None = None) -> None:
        """Waits until every save so far is committed; raises the first failure not already
        raised by its handle's wait() or by save(). Interruptible (Ctrl-C)."""
        if not self._wait_in_flight(timeout):
            raise TimeoutError(f"checkpoint saves still in flight after {timeout} s")
        self._in_flight = []
        failed, self._failed = [h for h in self._failed if not h._observed], []
        if failed:
            for h in failed:
                h._observed = True
            raise failed[0]._error  # type: ignore[misc]

    def wait_cleanup(self, timeout: float | None = None) -> None:
        """wait(), then until retention has deleted the steps it no longer keeps. Deleting runs
        in the background, off the saves' critical path; a benchmark timing back-to-back
        saves, or a caller about to measure free space, waits for it here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(timeout)
        done = self._purge.all_tasks_done
        with done:
            while self._purge.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"retention still deleting old steps after {timeout} s")
                done.wait(_POLL_S if left is None else min(_POLL_S, left))

    # -- loading --------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending (every lineage)."""
        return list(_C.committed_steps(self.root))

    def lineage(self) -> list[int]:
        """The steps of the current lineage, newest first: what load() tries, in order."""
        return roots.history(self.root, self.steps())[0]

    def latest_step(self) -> int | None:
        """The newest step of the current lineage, or None."""
        chain = self.lineage()
        return chain[0] if chain else None

    def load(self, state: Any, rank_state: Any = None, step: int | None = None, *,
             strict: bool = True, subset: bool = False,
             world_change: str = "warn") -> int | None:
        """Collective. Restores `state` (and this rank's `rank_state`) in place from `step`, or
        from the newest step of the current lineage that verifies on every rank.

        Returns the step restored (a step number counts the optimizer steps done when it was
        saved, so it is the next step to run), or None for a root with no committed step yet
        (only when the root exists and resilient initialised it, or with create=True). Strict
        by default: every tensor and value of the target is restored, or
        IncompatibleCheckpointError names each missing, unexpected or mismatched key and nothing
        was modified. subset=True loads only the top-level entries the target (a dict) has,
        strictly: the model of a {model, optim} checkpoint for evaluation. strict=False
        restores what matches and lists the rest in ``last_load``. A step that fails
        verification is skipped (``last_load.skipped``); CorruptCheckpointError when none
        verifies. CheckpointNotFoundError for a missing or foreign root or an unknown step.
        Per-rank state of a different world size: ranks that were not saved start fresh and
        saved ranks that no longer exist are dropped, with a warning (world_change="raise":
        IncompatibleCheckpointError).

        An error raised after reading began says whether the target was partly overwritten: its
        ``target_modified`` attribute (and a note on the exception); the target is then not
        the state it was, nor a checkpoint's: load again, or rebuild it, before training.
        """
        self._check_open()
        if world_change not in ("warn", "raise"):
            raise ValueError("world_change must be 'warn' or 'raise'")
        if subset and not isinstance(state, dict):
            raise TypeError("load(subset=True) takes a dict of top-level entries as the target "
                            f"state, not {type(state).__name__}")
        args = _LoadArgs(strict=strict, world_change=world_change, subset=subset)
        self._touched = False
        try:
            return self._load(state, rank_state, step, args)
        except BaseException as e:
            _mark_target(e, self._touched)
            raise

    def _load(self, state: Any, rank_state: Any, step: int | None,
              args: _LoadArgs) -> int | None:
        self.wait_snapshot()
        self._wait_in_flight()
        started = time.perf_counter()
        self._ranks.enter("load", step, check=True)  # before rank 0 fetches from a tier
        found: Any = None
        if self.rank == 0:
            try:
                self._fetch_newer(step)
                found = self._candidates(step)
            except Exception as e:  # every rank must hear it, not wait in the broadcast
                found = ("error", f"cannot list {self.root}: {type(e).__name__}: {e}")
        # Rank 0 may have fetched a step from a slower tier first (minutes for a large one).
        found = self._ranks.broadcast(
            (found, bool(self._tiers)), timeout=self.timeout if self._tiers else None)
        found, tiered = found
        if isinstance(found, str):
            raise CheckpointNotFoundError(found, self.root)
        if found[0] == "error":
            raise ResilientError(found[1])
        if found[0] == "corrupt":
            raise CorruptCheckpointError(found[1])
        steps, seqs = found
        if not steps:
            self.last_load = LoadReport()
            return None
        self._find_s = time.perf_counter() - started
        skipped: list[tuple[int, str]] = []
        self._dirty = None
        tried: dict[int, set[str]] = {}  # step -> tiers its copy was fetched from
        queue_ = list(steps)
        while queue_:
            s = queue_.pop(0)
            why = self._try_load(s, state, rank_state, args)
            if why is not None and tiered:
                got = None
                if self.rank == 0:  # the root's copy fails: a tier's may verify
                    got = fetch_into_root(self.root, self._tiers, s, seqs.get(s),
                                          exclude=tried.setdefault(s, set()))
                got = self._ranks.broadcast(got, timeout=self.timeout)
                if got is not None:
                    tried.setdefault(s, set()).add(got)
                    log.warning("step %d failed to load from %s (%s); retrying with the copy "
                                "from tier %s", s, self.root, why, got)
                    queue_.insert(0, s)
                    continue
            if why is None:
                self.last_load.skipped = skipped
                self._watch_steps_after_load(s, state)
                if self.rank == 0:
                    self._head = (s, seqs.get(s))
                    self._start_drainer()
                if skipped:
                    log.warning("loaded step %d after skipping %s", s,
                                "; ".join(f"step {k}: {w}" for k, w in skipped))
                return s
            log.warning("skipping checkpoint step %d: %s", s, why)
            skipped.append((s, why))
            if step is not None:
                local, self._skip_error = self._skip_error, None
                if local is not None:
                    raise local
                raise CorruptCheckpointError(f"step {s} of {self.root} failed to load: {why}")
        self.last_load = LoadReport(skipped=skipped)
        detail = "; ".join(f"step {s}: {why}" for s, why in skipped)
        raise CorruptCheckpointError(f"no checkpoint in {self.root} verifies: {detail}")

    def _watch_steps_after_load(self, step: int, state: Any) -> None:
        """Counts the optimizer steps the loaded state takes until the next save (a hook on each
        optimizer in `state`), so that save() can refuse to label a state trained past `step`
        with `step`: step numbers count the steps done (save(step + 1) after the step)."""
        self._stop_watching_steps()
        optimizers = _optimizers_in(state)
        counter = [0] * len(optimizers)  # steps of each optimizer (a GAN's two step apart)

        def counting(i: int) -> Callable[..., None]:
            def count(*_: Any) -> None:
                counter[i] += 1
            return count

        hooks = [o.register_step_post_hook(counting(i)) for i, o in enumerate(optimizers)]
        self._after_load = (step, counter, hooks)

    def _stop_watching_steps(self) -> None:
        loaded, self._after_load = self._after_load, None
        for h in loaded[2] if loaded is not None else ():
            h.remove()

    def _job_token(self) -> str | None:
        """Rank 0: what names this job in the root's lock file, so that WriterLock's takeover
        tells this job's removed writer from another job's: the launch attempt's id (resilient
        run, torchrun, srun), which every rank of every generation of the job shares, whatever
        its world size now (a lone survivor too); None outside a launcher (then there is no
        takeover)."""
        from resilient.recovery.environment import run_id

        rid = run_id()
        if rid is not None and rid.startswith("none."):  # torchrun without --rdzv-id: not unique
            rid += f"@{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        return rid

    def _check_step_number(self, step: int) -> None:
        """Raises ValueError for save(k) right after load() returned k and the optimizer took
        steps since: that save would label the state after k + n steps as step k (a loop that
        runs `for step in range(start, ...)` and saves `step` after `opt.step()`)."""
        loaded = self._after_load
        if loaded is None or loaded[0] != step or not any(loaded[1]):
            return
        n = max(loaded[1])
        raise ValueError(
            f"save({step}): the state was loaded from step {step} and the optimizer has taken "
            f"{n} step{'s' if n != 1 else ''} since, so this is the state after step "
            f"{step + n}, not {step}. A step number counts the steps done: load() returns the "
            f"number of the next step to run, and a loop that increments its counter after "
            f"opt.step() saves that counter (README, 'Quick start: checkpoints'). Nothing was "
            f"saved.")

    def _fetch_newer(self, step: int | None) -> None:
        """Rank 0, before a load: with tiers, fetch into the root the step to load when only a
        tier has it (`step`), or the newest commit of any tier when it is newer than the root's
        (a fresh node)."""
        if not self._tiers:
            return
        newer, self._tier_seq = newer_in_tiers(self.root, self._tiers)
        if step is not None:
            if not os.path.isdir(roots.step_dir(self.root, step)):
                fetch_into_root(self.root, self._tiers, step)
        elif newer is not None:
            fetch_into_root(self.root, self._tiers, newer[0], newer[1])
        self._max_seq = None  # the next commit's seq counts the fetched step

    def _start_drainer(self) -> None:
        """Rank 0 with tiers, at the first save or load: starts the copies to the tiers, with
        the root's newest step first (a copy that a crash or an earlier close cut short)."""
        if not self._tiers or self._drainer is not None or self.rank != 0:
            return
        try:
            self._lock.acquire()  # only the root's writer drains (not a job that only loads)
        except RootInUseError as e:
            log.info("not copying %s to its tiers: %s", self.root, e)
            return
        self._drainer = Drainer(self.root, self._tiers)
        head = self.latest_step() if roots.is_root(self.root) else None
        if head is not None:
            self._drainer.offer(head)

    def tier_status(self) -> list[dict[str, Any]]:
        """Rank 0: per tier, its URL, the steps it holds, the step pending or being copied, the
        last error and failure count, the bytes copied (empty without tiers or before the
        first save)."""
        return self._drainer.status() if self._drainer is not None else []

    def wait_tiers(self, timeout: float | None = None) -> bool:
        """Rank 0: waits until every tier holds the newest committed step (a failing tier keeps
        retrying: bound it with `timeout`). False when `timeout` ran out first."""
        return True if self._drainer is None else self._drainer.wait(timeout)

    def _candidates(self, step: int | None) -> Any:
        """Rank 0: (steps to try newest first, seq by step), or why there are none (a str)."""
        if not roots.is_root(self.root):
            if self.create and os.path.isdir(self.root):
                return [], {}
            return roots.why_not_root(self.root)
        steps = self.steps()
        chain, info = roots.history(self.root, steps)
        seqs = {s: (li.seq if isinstance(li, roots.Lineage) else None) for s, li in info.items()}
        if step is not None:
            if step not in steps:
                return f"no committed checkpoint for step {step} in {self.root} (it has {steps})"
            return [step], seqs
        # A step whose lineage record is damaged is no candidate (but is never deleted): its
        # branch is unknown. With committed steps and no candidate, "no checkpoint" would be a
        # silent fresh start: that is an error instead.
        candidates = [s for s in chain if info.get(s) is not roots.DAMAGED]
        damaged = [s for s in steps if info.get(s) is roots.DAMAGED]
        if damaged and not candidates:
            return ("corrupt", f"{self.root} holds committed steps {steps}, but the lineage "
                    f"records of steps {damaged} are damaged, so which one is newest in the "
                    "current run is unknown; pass load(step=...) to load one explicitly")
        newer = [s for s in damaged if candidates and s > candidates[0]]
        if newer:
            log.warning("steps %s of %s have damaged lineage records and are not loaded; "
                        "loading %d instead (load(step=...) loads one explicitly)",
                        newer, self.root, candidates[0])
        return candidates, seqs

    def _try_load(self, step: int, state: Any, rank_state: Any, args: _LoadArgs) -> str | None:
        try:
            return self._try_load_step(step, state, rank_state, args)
        except IncompatibleCheckpointError as e:
            if self._dirty is not None:  # "nothing was modified" is no longer true
                e.args = (f"{e.args[0]} (but a failed read of step {self._dirty}, skipped "
                          "before this one, already wrote part of its data into the target)",)
            raise

    def _try_load_step(self, step: int, state: Any, rank_state: Any,
                       args: _LoadArgs) -> str | None:
        """Loads `step` on every rank, or returns why it was skipped (the same on every rank).
        Raises on every rank when the state does not fit or an unexpected error occurs."""
        prepared: Any = None
        self._skip_error = None
        stamps = [time.perf_counter()]
        try:
            prepared = self._prepare(step, state, rank_state, args)
            outcome: Any = ("ok", prepared.issues if prepared.issues else None)
        except _SKIPPABLE as e:
            outcome = ("skip", f"rank {self.rank}: {type(e).__name__}: {e}")
            self._skip_error = e
        except IncompatibleCheckpointError as e:
            outcome = ("incompatible", str(e))
        except Exception as e:
            outcome = ("fatal", f"rank {self.rank}: {type(e).__name__}: {e}")
            prepared = e
        outcomes = self._ranks.gather(outcome)
        stamps.append(time.perf_counter())
        _raise_agreed(outcomes, outcome, prepared, args.strict, step)
        skips = [o[1] for o in outcomes if o[0] == "skip"]
        if skips:
            return "; ".join(skips)
        read_error: BaseException | None = None
        self._touched = True  # from here on the target may hold bytes of this step
        try:
            prepared.read()
            read_outcome: Any = None
        except CollectiveError:  # the group broke mid-read (a peer stopped, an abort): the
            raise  # others raise from the store's mark, not from a gather that would pair wrong
        except _SKIPPABLE as e:
            read_outcome, read_error = ("skip", f"rank {self.rank}: {type(e).__name__}: {e}"), e
            self._skip_error = e
        except Exception as e:
            read_outcome, read_error = ("fatal", f"rank {self.rank}: {type(e).__name__}: {e}"), e
        stamps.append(time.perf_counter())
        # after the reads: ranks may end them minutes apart (the checkpointer's own timeout)
        reads = [o for o in self._ranks.gather(read_outcome, self.timeout) if o is not None]
        stamps.append(time.perf_counter())
        if read_error is not None and read_outcome[0] == "fatal":
            raise read_error
        fatal = [msg for kind, msg in reads if kind == "fatal"]
        if fatal:
            raise ResilientError(f"loading step {step} failed on another rank: {fatal[0]}")
        if reads:
            self._dirty = step  # the target may hold part of this step's bytes
            return "; ".join(msg for _, msg in reads)
        finish_error: BaseException | None = None
        try:
            prepared.finish()
        except Exception as e:  # e.g. a load_state_dict() that raises on this rank
            finish_error = e
        finished = self._ranks.gather((None if finish_error is None else
                                       f"rank {self.rank}: {type(finish_error).__name__}: "
                                       f"{finish_error}", prepared.reader.bytes_read))
        if finish_error is not None:
            raise finish_error
        if any(f is not None for f, _ in finished):
            raise ResilientError(f"loading step {step} failed on another rank while putting "
                                 f"values in place: {[f for f, _ in finished if f][0]}")
        stamps.append(time.perf_counter())
        spent = [round(b - a, 4) for a, b in zip(stamps, stamps[1:])]
        seconds = {"find": round(self._find_s, 4), "prepare": spent[0],
                   **(prepared.reader.seconds or {"read": spent[1]}),
                   "agree_reads": spent[2], "finish": spent[3]}
        issues = prepared.issues
        self.last_load = LoadReport(step=step, missing=issues.missing,
                                    unexpected=issues.unexpected, mismatched=issues.mismatched,
                                    bytes_read=sum(n for _, n in finished), seconds=seconds)
        if issues and self._dirty is not None:
            log.warning("entries left as they were may hold bytes of step %d, whose read failed "
                        "before this load", self._dirty)
        if issues:
            log.warning("step %d loaded with strict=False; left as they were: %s", step,
                        "; ".join(issues.missing + issues.unexpected + issues.mismatched)[:2000])
        return None

    def _prepare(self, step: int, state: Any, rank_state: Any, args: _LoadArgs) -> _Prepared:
        manifest = self._native.manifest(step)
        try:
            values = json.loads(manifest.values_json)
            fmt = values.get("format") if isinstance(values, dict) else None
            if fmt != FORMAT:
                raise VersionMismatchError(
                    f"step {step}: checkpoint values format {fmt!r} is not {FORMAT!r} (written by "
                    "another version of resilient)")
            ranks = values["ranks"]
            if not isinstance(ranks, list) or not ranks or not all(
                    isinstance(r, dict) for r in ranks):
                raise ValueError("no per-rank records")
            entries: dict[str, dict] = {}
            saved: dict[str, list[Saved]] = {}
            for e in manifest.tensors():
                if e["name"] in entries:
                    raise ValueError(f"tensor {e['name']!r} listed twice")
                entries[e["name"]] = e
                piece = _piece(e)
                if piece is not None:
                    saved.setdefault(piece[0], []).append(piece[1])
                elif e["name"].startswith("S/"):
                    raise ValueError(f"bad piece name {e['name']!r}")
            for r in ranks:  # the whole document is well-formed before anything is planned
                codec.decode(r.get("state"), _placeholder)
                codec.decode(r.get("rank_state"), _placeholder)
            prep = _Prepared(self, step, manifest, entries)
            doc = ranks[0].get("state")
            prep.plan_state(contract.entries(doc, list(state)) if args.subset else doc, state,
                            saved)
            if rank_state is not None:
                prep.plan_rank_state(ranks, rank_state, args.world_change)
            elif (self.rank == 0 and len(ranks) > self.world_size
                  and args.world_change == "raise"):
                raise IncompatibleCheckpointError(
                    f"step {step} was saved by {len(ranks)} ranks, this job has "
                    f"{self.world_size}")
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            if isinstance(e, IncompatibleCheckpointError):
                raise
            raise CorruptCheckpointError(
                f"step {step}: malformed checkpoint values: {type(e).__name__}: {e}",
                path=roots.step_dir(self.root, step)) from e
        return prep

    # -- reading tools --------------------------------------------------------------------
    def read_global(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """This process alone: every replicated tensor of `step` (default: the newest of the
        lineage) assembled to its global shape, by logical name ("model/fc1.weight"), and
        per-rank tensors as "R<rank>/<name>". For tools, tests and converting formats."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.root}", self.root)
        manifest = self._native.manifest(step)
        entries = {e["name"]: e for e in manifest.tensors()}
        reader = Reader(self._native, manifest, entries)
        saved: dict[str, list[Saved]] = {}
        out: dict[str, Any] = {}
        for e in entries.values():
            piece = _piece(e)
            if piece is None:
                shape = tuple(e["shape"])
                s = Saved(e["name"], e["dtype"], shape, shape, tuple(0 for _ in shape))
                out[e["name"]] = reader.want(e["name"], None, e["dtype"], shape, None, [s])
                continue
            saved.setdefault(piece[0], []).append(piece[1])
        for name, pieces in saved.items():
            g = pieces[0].global_shape
            out[name] = reader.want(name, None, pieces[0].dtype, g, None, pieces)
        reader.run()
        return {n: w.out for n, w in out.items()}

    def verify(self, step: int) -> None:
        """Reads every chunk of `step` and checks its checksum; raises CorruptCheckpointError."""
        self._native.verify(self._native.manifest(step))

    # -- lifetime -------------------------------------------------------------------------
    def _wait_in_flight(self, timeout: float | None = None) -> bool:
        """Waits for the saves in flight and the retention after them (a load must not race
        the deletion of old steps for the disk). False when `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in list(self._in_flight):
            for event in (h._event, h._retained):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not _wait_event(event, left):
                    return False
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"checkpointer for {self.root} is closed")

    def close(self, timeout: float | None = None) -> None:
        """Waits for saves in flight (raising the first failure) and stops the commit thread.
        Interruptible (Ctrl-C), and TimeoutError when `timeout` passes first: the checkpointer
        then stays open and keeps the root's writer lock while its saves go on (a save still
        running may yet commit: no other writer may take the root meanwhile), and close() can
        be called again; at exit the handler closes it (bounded by RESILIENT_EXIT_TIMEOUT_S)."""
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.wait(timeout)
        except (KeyboardInterrupt, TimeoutError):
            if not self._wait_in_flight(0):
                raise  # saves still running: stay open, keep the lock
            self._shutdown(deadline)
            raise
        except BaseException:
            self._shutdown(deadline)
            raise
        self._shutdown(deadline)

    def _shutdown(self, deadline: float | None) -> None:
        """Stops the threads and the engine; every wait shares `deadline` (monotonic), so a
        close(timeout) takes at most `timeout` in all."""

        def left(cap: float | None = None) -> float | None:
            rest = None if deadline is None else max(0.0, deadline - time.monotonic())
            return cap if rest is None else (rest if cap is None else min(cap, rest))

        self._closed = True
        self._stop_watching_steps()
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(left())
        if self.rank == 0 and self.world_size > 1:
            self._wait_outcomes_read(left(30.0))  # type: ignore[arg-type]
        if self._drainer is not None:  # abandon() (a lost rank): the copies are not waited for
            self._drainer.close(left(0.0 if self._no_tier_wait else tiers_close_timeout()))
        self._purge.put(None)  # deleted steps' space is freed before close() returns
        if threading.current_thread() is not self._thread:
            self._purger.join(left())
        try:
            self._native.close(left())
        finally:
            self._lock.release()
            _OPEN.discard(self)

    def abandon_in_flight(self, reason: str) -> list[SaveHandle]:
        """Marks every save not yet committed as abandoned in the job's store: each rank's
        commit stops waiting for a peer's report or for rank 0's outcome (what a lost rank
        leaves waiting) and fails at once. Safe from another thread. Returns those saves."""
        pending = [h for h in list(self._in_flight) if not h.done()]
        for h in pending:
            try:
                self._ranks.store.set(f"resilient/ckpt/{h.save_id}/abandoned", reason)
            except Exception as e:  # the store is gone too: the waits end by their timeouts
                log.warning("cannot mark the save of step %d abandoned: %s", h.step, e)
        return pending

    def abandon(self, reason: str, timeout: float | None = None) -> list[int]:
        """Closes this checkpointer after its group lost a rank (in-process recovery): saves
        not yet committed are given up at once (abandon_in_flight) instead of waiting for the
        lost rank, nothing waits for the lost rank to read an outcome, and the root's writer
        lock is released, so a checkpointer over the survivors' group can take over. Every
        survivor calls it. A save whose every rank had reported may still commit (rank 0 was
        already committing it); either way the root holds only whole checkpoints. This rank's
        own writes still finish first (``timeout``, default the checkpointer's). Returns the
        steps whose saves did not commit; raises nothing for them.

        Raises:
            TimeoutError: a save was still running after ``timeout``; the checkpointer stays
                open and keeps the root locked (handing the root over could let two writers
                commit into it).
        """
        if self._closed:
            return []
        timeout = self.timeout if timeout is None else timeout
        pending = self.abandon_in_flight(reason)
        if not self._wait_in_flight(timeout):
            raise TimeoutError(
                f"saves of steps {[h.step for h in pending if not h.done()]} still running "
                f"{timeout:g} s after they were abandoned; the root stays locked")
        with self._lock_ids:
            self._published = []  # the lost rank will never read them (after the wait)
            for h in pending:
                h._observed = True
        lost = [h.step for h in pending if h._error is not None]
        self._no_tier_wait = True
        self._shutdown(time.monotonic() + timeout)
        return lost

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def io_backend(self) -> str:
        """ "io_uring" or "threads"."""
        return self._native.io_backend

    @property
    def pool_pinned(self) -> bool:
        """Whether the host buffer pool is pinned (page-locked for device copies)."""
        return self._native.pool_pinned


class _Prepared:
    """One rank's plan to load one step: what to read where, and how to finish."""

    def __init__(self, ck: Checkpointer, step: int, manifest: Any, entries: dict[str, dict]):
        self.ck, self.step, self.manifest, self.entries = ck, step, manifest, entries
        self.reader = Reader(ck._native, manifest, entries)
        self.issues = contract.Issues()
        self.plans: list[tuple[contract.LoadPlan, dict[str, Any], Any]] = []
        self.rank_dropped = False

    def plan_state(self, doc: Any, state: Any, saved: dict[str, list[Saved]]) -> None:
        wanted: dict[str, Any] = {}

        def check(name: str, live: torch.Tensor | None, path: str,
                  like: torch.Tensor | None = None) -> str | None:
            pieces = saved.get(name)
            if not pieces:
                raise CorruptCheckpointError(
                    f"step {self.step}: the values reference tensor {name!r}, which has no data")
            dtensor = None
            if (live is None and like is not None and pieces[0].global_shape == tuple(like.shape)
                    and self.ck.spec_for(name, None, pieces[0].global_shape) is None):
                # a fresh optimizer's state: laid out like its parameter (sharded, on its device)
                live = torch.zeros_like(like, dtype=codec.dtype_from_name(pieces[0].dtype))
            if live is not None and is_dtensor(live):
                dtensor = live
                live, spec = local_chunk(live)  # contract.unwritable checked it has one
                shape, dtype = tuple(live.shape), codec.dtype_name(live.dtype)
                why = contract.layout_mismatch((pieces[0].dtype, pieces[0].global_shape),
                                               (dtype, spec.global_shape))
                if why:
                    return why
            elif live is not None:
                shape, dtype = tuple(live.shape), codec.dtype_name(live.dtype)
                spec = self.ck.spec_for(name, shape, None)
                gshape = tuple(spec.global_shape) if spec else shape
                why = contract.layout_mismatch((pieces[0].dtype, pieces[0].global_shape),
                                               (dtype, gshape))
                if why:
                    return why
            else:
                spec = self.ck.spec_for(name, None, pieces[0].global_shape)
                shape = tuple(spec.shape) if spec else pieces[0].global_shape
                dtype = pieces[0].dtype
            try:
                if spec is not None:
                    spec.check(name, shape)
                wanted[name] = self.reader.want(name, live, dtype, shape, spec, pieces)
            except ValueError as e:
                return _reason(e, name)
            if dtensor is not None:
                wanted[name].target = dtensor  # read into its local chunk, restored as itself
            return None

        plan = contract.plan_load(doc, state, check)
        self.issues.extend(plan.issues)
        self.plans.append((plan, wanted, None))

    def plan_rank_state(self, ranks: list, rank_state: Any, world_change: str) -> None:
        rank, world = self.ck.rank, self.ck.world_size
        saved_world = len(ranks)
        if world_change == "raise" and saved_world != world:
            raise IncompatibleCheckpointError(
                f"step {self.step} holds per-rank state of {saved_world} ranks, this job has "
                f"{world} (world_change='raise')")
        if rank == 0 and saved_world > world:
            log.warning("step %d: per-rank state of ranks %d..%d dropped (saved by %d ranks, "
                        "this job has %d)", self.step, world, saved_world - 1, saved_world, world)
        if rank >= saved_world:
            log.warning("step %d was saved by %d ranks: rank %d's per-rank state starts fresh",
                        self.step, saved_world, rank)
            self.rank_dropped = True
            return
        rdoc = ranks[rank].get("rank_state")
        wanted: dict[str, Any] = {}

        def check(name: str, live: torch.Tensor | None, path: str,
                  like: torch.Tensor | None = None) -> str | None:
            e = self.entries.get(f"R{rank}/{name}")
            if e is None:
                raise CorruptCheckpointError(
                    f"step {self.step}: per-rank tensor {name!r} of rank {rank} has no data")
            shape = tuple(e["shape"])
            s = Saved(e["name"], e["dtype"], shape, shape, tuple(0 for _ in shape))
            why = live is not None and contract.layout_mismatch(
                (e["dtype"], shape), (codec.dtype_name(live.dtype), live.shape))
            if why:
                return why
            try:
                wanted[name] = self.reader.want(
                    name, live, e["dtype"] if live is None else codec.dtype_name(live.dtype),
                    shape if live is None else tuple(live.shape), None, [s])
            except ValueError as err:
                return _reason(err, name)
            return None

        if rdoc is None:
            rdoc = {}
        plan = contract.plan_load(rdoc, rank_state, check, root_path="<rank_state>")
        self.issues.extend(plan.issues)
        self.plans.append((plan, wanted, None))

    def read(self) -> None:
        ck = self.ck
        if ck.restore == "redistribute" and ck.world_size > 1:
            self.reader.run_redistributed(ck._ranks.group, ck.rank, ck.world_size, None,
                                          ranks=ck._ranks, data_timeout=ck.timeout)
        elif ck.restore == "shared" and ck.world_size > 1:
            tag = f"{ck._ranks.run_id}-{self.step}-{ck._ranks._seq}"
            self.reader.run_shared(ck._ranks.group, ck.rank, ck.world_size, None, tag,
                                   ranks=ck._ranks, data_timeout=ck.timeout)
        else:
            self.reader.run()

    def finish(self) -> None:
        for plan, wanted, _ in self.plans:
            plan.finish({name: w.result() for name, w in wanted.items()})


def _purge_loop(work: queue.Queue) -> None:
    while (path := work.get()) is not None:
        try:
            roots.purge_trash(path)
        finally:
            work.task_done()
    work.task_done()


def _commit_loop(work: queue.Queue) -> None:
    """The commit thread: commits queued saves in order; None ends it."""
    while True:
        handle = work.get()
        if handle is None:
            return
        owner, handle._owner = handle._owner, None
        try:
            owner._commit_one(handle)
        finally:
            del owner


def _piece(e: dict) -> tuple[str, Saved] | None:
    """(logical name, Saved) of a manifest entry that is a piece of replicated state
    ("S/<name>#@<offset>"); None for any other entry."""
    split = split_piece_name(e["name"][2:]) if e["name"].startswith("S/") else None
    if split is None:
        return None
    shape = tuple(e["shape"])
    return split[0], Saved(e["name"], e["dtype"], shape, tuple(e.get("global_shape", shape)),
                           split[1])


def _placeholder(kind: str, name: str) -> Any:
    if not isinstance(name, str):
        raise ValueError("malformed checkpoint values: a tensor name is not a string")
    return torch.empty(0)


def _reason(e: ValueError, name: str) -> str:
    msg = str(e)
    prefix = f"tensor {name!r}: "
    return msg[len(prefix):] if msg.startswith(prefix) else msg


def _raise_agreed(outcomes: list, mine: Any, prepared: Any, strict: bool, step: int) -> None:
    """After the plan phase: raise the same kind of error on every rank when some rank's
    plan failed for a reason other than corruption, or (strict) does not fit."""
    fatal = [o[1] for o in outcomes if o[0] == "fatal"]
    if fatal:
        if mine[0] == "fatal":
            raise prepared
        raise ResilientError(f"loading step {step} failed on another rank: {fatal[0]}")
    incompatible = [o[1] for o in outcomes if o[0] == "incompatible"]
    if incompatible:
        raise IncompatibleCheckpointError(incompatible[0] if mine[0] != "incompatible"
                                          else mine[1])
    if any(o[0] == "skip" for o in outcomes) or not strict:
        return
    if mine[1] is not None:
        raise mine[1].error(f"step {step}")
    unfit = [r for r, o in enumerate(outcomes) if o[1] is not None]
    if unfit:
        theirs = outcomes[unfit[0]][1]
        raise IncompatibleCheckpointError(
            f"on rank(s) {unfit}: {theirs.error(f'step {step}')}", theirs.missing,
            theirs.unexpected, theirs.mismatched)


def _check_positional_specs(specs: Any, tensors: dict[str, Any]) -> None:
    """A spec naming optimizer state by position ('optim/state/2/*') that matches nothing: the
    optimizer is saved by parameter name, and the spec would silently not apply."""
    for key in specs:
        m = re.search(r"/state/\d+(/|$)", key)
        if m and not any(key == n or (key.endswith("*") and fnmatchcase(n, key))
                         for n in tensors):
            raise ValueError(
                f"spec {key!r} matches no saved tensor: an optimizer saved with its model is keyed "
                "by parameter name ('optim/state/<parameter name>/exp_avg'), and its state "
                "inherits the parameter's spec; drop the optimizer specs or name the parameter")


def _fingerprints(tensors: dict[str, torch.Tensor],
                  skip: set[str]) -> list[tuple[int, int] | None]:
    """A fingerprint of each tensor's bytes (wrapping sums of its 8-byte words and of its
    tail), computed where the tensor lives; one device-to-host copy for all CUDA tensors.
    None for the tensors in `skip` (held by this rank alone). Small host tensors (an optimizer's
    step counters) are summed natively in one call when dense (`_C.word_sums`), else in Python:
    a few torch calls each would cost more than the bytes."""
    sums = []
    out: list[Any] = []
    dense_at, ptrs, sizes = [], [], []
    for name, t in tensors.items():
        if name in skip:
            out.append(None)
            continue
        if t.is_cpu and t.nbytes <= _SMALL_PRINT_BYTES:
            if t.is_contiguous() and not t.is_conj() and not t.is_neg():
                dense_at.append(len(out))
                ptrs.append(t.data_ptr())
                sizes.append(t.nbytes)
                out.append(())  # filled below
            else:
                out.append(_small_fingerprint(t))
            continue
        if t.numel() == 0:  # no bytes (and views of its strides may not exist)
            out.append((0, 0))
            continue
        b = _bytes_of(t)
        n8 = b.numel() // 8 * 8
        try:
            words = b[:n8].view(torch.int64)
        except RuntimeError:  # misaligned storage offset
            words = b[:n8].clone().view(torch.int64)
        tail = b[n8:].to(torch.int64)
        sums.append(torch.stack([words.sum(), tail.sum() + 256 * b.numel()]))
        out.append(len(sums) - 1)
    for i, fp in zip(dense_at, _C.word_sums(ptrs, sizes)):
        out[i] = fp
    host = [s.cpu() if s.device.type != "cpu" else s for s in sums]
    values = torch.stack(host).tolist() if host else []
    return [tuple(int(x) for x in values[v]) if isinstance(v, int) else v for v in out]


_SMALL_PRINT_BYTES = 256


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes written for `t` (conjugate and negative views resolved), as a 1-D uint8 view
    of a dense copy where `t` is not dense (a size-1 dimension may have any stride)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.dim() and t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.reshape(-1).view(torch.uint8)


def _small_fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """_fingerprints' value for a small host tensor, computed on its bytes in Python: the
    wrapping int64 sum of its 8-byte words, and the sum of its tail bytes + 256 x its size."""
    b = None
    if t.is_contiguous():  # numpy copies a dense array's bytes as they are (a strided copy of a
        try:  # bool array would turn a byte 2 into 1)
            b = (t.detach() if t.requires_grad else t).numpy().tobytes()
        except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16), conjugate views
            pass
    if b is None:
        b = _bytes_of(t).numpy().tobytes() if t.numel() else b""
    n8 = len(b) // 8 * 8
    words = sum(int.from_bytes(b[i:i + 8], "little", signed=True) for i in range(0, n8, 8))
    return (words + 2**63) % 2**64 - 2**63, sum(b[n8:]) + 256 * len(b)


def _check_replicas(held_by_rank: list[list[Held]], prints_by_rank: list[Any]) -> None:
    seen: dict[tuple, tuple[int, tuple[int, int]]] = {}
    diffs = []
    for rank, (held, prints) in enumerate(zip(held_by_rank, prints_by_rank)):
        for h, fp in zip(held, prints or ()):
            if fp is None:
                continue
            first = seen.setdefault(h.key, (rank, tuple(fp)))
            if first[1] != tuple(fp):
                diffs.append(f"{h.name!r} (rank {first[0]} vs rank {rank})")
    if diffs:
        raise ReplicaMismatchError(
            f"replicated state differs between ranks: {', '.join(sorted(set(diffs))[:10])}; "
            "state passed as `state` must be identical on every data-parallel rank (it is "
            "written once); per-rank values (RNG state, running statistics) belong in "
            "rank_state")


_OPTIM_STATE = re.compile(r"^.+/state/(?P<param>[^/]+)/[^/]+$")

# How a rank's failure travels in its report (the job's store) so that every rank raises the
# same exception type: "OSError[28]: ..." or "TimeoutError: ...".
_CAUSE = re.compile(r"\b(?:OSError\[(?P<errno>\d+)\]|(?P<timeout>TimeoutError)): ")


def _cause_text(e: BaseException) -> str:
    """A rank's own save failure as its report's text (cause tag, message, file)."""
    if isinstance(e, OSError) and e.errno and not isinstance(e, TimeoutError):
        what = re.sub(r"^saving step \d+: ", "", str(e.strerror or e))
        return f"OSError[{e.errno}]: {what}" + (f" ({e.filename})" if e.filename else "")
    if isinstance(e, TimeoutError):
        return f"TimeoutError: {e}"
    return f"{type(e).__name__}: {e}"


def _parse_cause(text: str) -> tuple[str, Any]:
    """(text without its first cause tag, the cause: an errno, "timeout" or None)."""
    m = _CAUSE.search(text)
    if m is None:
        return text, None
    cause = int(m["errno"]) if m["errno"] else "timeout"
    return text[: m.start()] + text[m.end():], cause


def _commit_failure(message: str, cause: Any) -> CheckpointCommitError:
    if isinstance(cause, int):
        return commit_error(message, errno=cause)
    return commit_error(message, timeout=cause == "timeout")


def _cause_of(e: BaseException | None) -> Any:
    """The cause of a CheckpointCommitError, as _parse_cause gives it."""
    if isinstance(e, OSError) and e.errno and not isinstance(e, TimeoutError):
        return e.errno
    return "timeout" if isinstance(e, TimeoutError) else None


def _failure_text(e: BaseException | None) -> str:
    """A failed save's error as save() repeats it: its message, without an errno prefix."""
    if isinstance(e, OSError) and e.strerror:
        return str(e.strerror) + (f" ({e.filename})" if e.filename else "")
    return str(e)


def _wait_event(event: threading.Event, timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        if left <= 0:
            return event.is_set()
        if event.wait(left):
            return True


def _wait_native(wait: Any, timeout: float | None, done: Any) -> None:
    """Calls a native wait(timeout) in slices so that KeyboardInterrupt gets through; a
    TimeoutError of a finished operation is its own error, raised at once."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        try:
            wait(max(0.0, left))
            return
        except TimeoutError:
            if done() or (deadline is not None and time.monotonic() >= deadline):
                raise


def _close_at_exit() -> None:
    """Process exit waits for saves in flight, RESILIENT_EXIT_TIMEOUT_S (default 60 s) in all,
    saying what it waits for; a second Ctrl-C ends the wait (the last committed checkpoint
    stays intact, the unfinished save is never committed)."""
    try:
        limit = settings.get("RESILIENT_EXIT_TIMEOUT_S")
    except ValueError as e:
        log.error("%s; waiting 60 s", e)
        limit = 60.0
    open_ = list(_OPEN)
    pending = {ck.root: [h.step for h in ck._in_flight if not h.done()] for ck in open_}
    pending = {root: steps for root, steps in pending.items() if steps}
    try:  # a second Ctrl-C may come at any point from the message on
        if pending:
            what = "; ".join(f"step{'s' if len(v) > 1 else ''} {', '.join(map(str, v))} in {r}"
                             for r, v in pending.items())
            log.warning("exiting: waiting up to %g s (RESILIENT_EXIT_TIMEOUT_S) for the "
                        "checkpoint save of %s to commit; press Ctrl-C again to abandon it (the "
                        "last committed checkpoint stays intact)", limit, what)
        deadline = time.monotonic() + limit
        for ck in open_:
            try:
                ck.close(max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - exiting anyway
                log.error("checkpoint saves not finished at exit: %s", e)
    except KeyboardInterrupt:
        log.warning("exiting: checkpoint saves abandoned (a second Ctrl-C): the process ends "
                    "without waiting for them (a save at its very last step may still commit); "
                    "the last committed checkpoint stays intact")


atexit.register(_close_at_exit)

# RESILIENT_STORE=etcd://: env:// follows it now that torch is imported (resilient.checkpoint
# imports this module on first use, so its own call may come before torch).
_follow_store_setting()
