"""Peer replicas of sharded training state (FSDP2, tensor parallel): each rank's shard is copied,
in the background, into the host memory of a peer on another host, so that the shard of a lost
rank still exists in memory (restored by ``resilient.recovery.reshard``).

After each optimizer step the training thread calls :meth:`PeerReplicas.replicate`. It copies
the rank's local shards (the model's and the optimizer's, plus the small values beside them:
learning rates, ``step`` counters) into one of two reusable host buffers: on GPUs an
asynchronous device-to-host copy on a side stream, which the next ``optimizer.step`` waits for
(a step pre-hook), so training does not wait for it. A sender thread then checksums the buffer
(XXH3) and sends it over a gloo group of its own to the rank's buddies. Receiver threads keep the
two newest verified replicas of each peer they back up (a replica arrives in a third buffer and
replaces the older one only once it verified). Every rank snapshots the same steps, so that a
step held for every rank always exists: if the previous snapshot is still being sent when the
next is due, ``replicate`` waits for it (``stats.waited_s``). ``RESILIENT_REPLICA_EVERY=N``
snapshots every N-th step; the default (0) chooses the interval so that a send fits: at the
second due step, and every :data:`RECALIBRATE` after, the ranks agree (an all-reduce of the
slowest send, a send still running counted with its time so far, and of the slowest step on the
replicas' group) on ``ceil(MARGIN * send / step)`` steps. While a send still runs on any rank,
every rank skips that snapshot and agrees again at the next due step, so an agreement never
waits for a send; a rank whose replication broke still takes part. A send that
does not finish within ``RESILIENT_RECOVERY_GROUP_TIMEOUT_S`` stops the replication (logged; a
restore then falls back to storage) rather than stall training.

Buddies (:func:`buddies`): ranks are listed host by host (RESILIENT_HOST_ID, else the hostname)
and each rank backs up the rank ``m``, ``2m``, ... places further in that list, ``m`` being the
largest host's number of ranks: with equal hosts, every rank's replicas are on other hosts, and
every rank holds ``factor`` replicas.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resilient import settings
from resilient.checkpoint.dtensor import is_dtensor, local_chunk_info

log = logging.getLogger("resilient.recovery")

_ALIGN = 64
_MAGIC = 0x5245504C  # "REPL"
_HEADER = 7  # magic, step, nbytes, digest, meta bytes, sender rank, world
#: RESILIENT_REPLICA_EVERY=0: the interval is agreed again every this many snapshots
RECALIBRATE = 32
#: ... to this many times the slowest send over the slowest step (sends compete with training
#: for host memory bandwidth and CPU; a send that fits only just would still delay steps)
MARGIN = 1.5
#: the longest interval chosen (a replica at most this many steps old)
MAX_EVERY = 1000


def buddies(hosts: list[str], factor: int = 1) -> list[list[int]]:
    """For each rank, the ranks that hold its replicas (pure).

    `hosts[r]` is rank r's host. Ranks are ordered host by host (hosts in the order of their
    first rank); rank r's k-th buddy is k * m places further in that order (cyclically), m the
    largest host's size. Every rank is the buddy of exactly `factor` ranks, and with hosts of
    equal size no rank's buddy shares its host. One host: the next ranks.
    """
    world = len(hosts)
    if world < 2 or factor <= 0:  # 0: no peer copies (HSDP: the replica groups hold them)
        return [[] for _ in hosts]
    factor = min(int(factor), world - 1)
    order: list[int] = []
    first: dict[str, int] = {}
    for r, h in enumerate(hosts):
        first.setdefault(h, r)
    for h in sorted(first, key=first.get):
        order += [r for r in range(world) if hosts[r] == h]
    largest = max(sum(1 for x in hosts if x == h) for h in first)
    shift = largest if largest < world else 1
    # the same offsets (in the host-ordered list) for every rank, so each offset is a
    # permutation: multiples of the shift first (other hosts), then the rest
    offsets: list[int] = []
    for d in [k * shift % world for k in range(1, world)] + list(range(1, world)):
        if d and d not in offsets:
            offsets.append(d)
    offsets = offsets[:factor]
    pos = {r: i for i, r in enumerate(order)}
    return [[order[(pos[r] + d) % world] for d in offsets] for r in range(world)]


@dataclass(frozen=True)
class Entry:
    """One tensor of a snapshot: its key (a JSON path into the state), dtype, its box in the
    global tensor, and where its bytes start in the buffer."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    start: int
    nbytes: int
    replicated: bool


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The model's and the optimizer's state keyed by parameter names (FQN), DTensors kept:
    torch.distributed.checkpoint.state_dict.get_state_dict, which also creates a fresh
    optimizer's state (so a new optimizer has every tensor a restore fills)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def flatten(state: Any) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """(tensors as (key, tensor)), other leaves as {key: value}) of a nested dict/list state;
    keys are JSON lists of the path."""
    tensors: list[tuple[str, Any]] = []
    leaves: dict[str, Any] = {}

    def walk(x: Any, path: list) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, [*path, k if isinstance(k, (str, int)) else str(k)])
        elif isinstance(x, (list, tuple)) and not _is_plain(x):
            for i, v in enumerate(x):
                walk(v, [*path, i])
        elif isinstance(x, torch.Tensor):
            tensors.append((json.dumps(path), x))
        else:
            leaves[json.dumps(path)] = x

    walk(state, [])
    return tensors, leaves


def _is_plain(x: Any) -> bool:
    """A list/tuple of plain values (betas, a param group's parameter names): one leaf."""
    return all(isinstance(v, (int, float, str, bool)) or v is None for v in x)


def local_view(t: Any) -> tuple[torch.Tensor, tuple, tuple, bool]:
    """(local tensor, global shape, offset, replicated) of a tensor or DTensor."""
    if is_dtensor(t):
        local, place, replicated = local_chunk_info(t)
        return local, place.global_shape, place.offset, replicated
    shape = tuple(int(s) for s in t.shape)
    return t.detach(), shape, tuple(0 for _ in shape), True


def dtype_of(name: str) -> torch.dtype:
    """torch.float32 from "torch.float32"."""
    d = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


def layout(tensors: list[tuple[str, Any]]) -> tuple[list[Entry], list[torch.Tensor], int]:
    """The snapshot's entries (64-byte aligned), their local tensors, and the buffer size."""
    entries, locals_, at = [], [], 0
    for key, t in tensors:
        local, gshape, offset, replicated = local_view(t)
        n = local.numel() * local.element_size()
        entries.append(Entry(key, str(local.dtype), gshape, offset,
                             tuple(int(s) for s in local.shape), at, n, replicated))
        locals_.append(local)
        at += -(-n // _ALIGN) * _ALIGN
    return entries, locals_, at


def entry_tensor(buf: torch.Tensor, e: Entry) -> torch.Tensor:
    """The entry's bytes in `buf` viewed as its local tensor."""
    return buf[e.start:e.start + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)


def _digest(buf: torch.Tensor, n: int) -> int:
    from resilient import _C

    return int(_C.xxh3_buffer(buf.data_ptr(), n)) if n else 0


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


@dataclass
class Snapshot:
    """One rank's state at one step: entries, leaves (JSON-able values) and bytes."""

    rank: int  # the rank in the group the snapshot was taken in
    world: int
    step: int
    entries: list[Entry]
    leaves: dict[str, Any]
    buf: torch.Tensor
    nbytes: int
    digest: int = 0
    digest_s: float = 0.0  # seconds the sender took to checksum it
    ready: Any = None  # a CUDA event while the device-to-host copy may be running
    state: str = "writing"  # writing -> ok | bad
    extra: dict = field(default_factory=dict)  # the caller's JSON-able state (replicate)

    def meta(self) -> bytes:
        return json.dumps({"rank": self.rank, "world": self.world, "step": self.step,
                           "leaves": self.leaves, "extra": self.extra,
                           "entries": [[e.key, e.dtype, e.global_shape, e.offset, e.shape,
                                        e.start, e.nbytes, e.replicated] for e in self.entries]},
                          default=_jsonable).encode()

    def verify(self, constant: frozenset = frozenset()) -> bool:
        """The buffer still has the digest it was sent or received with, and every floating
        tensor but the `constant` keys (buffers: a causal mask may hold -inf) is finite (a
        diverged state is not worth restoring)."""
        if _digest(self.buf, self.nbytes) != self.digest:
            return False
        for e in self.entries:
            if e.key in constant:
                continue
            t = entry_tensor(self.buf, e)
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                return False
        return True


def _jsonable(x: Any) -> Any:
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    raise TypeError(f"a {type(x).__name__} value in the optimizer state cannot be replicated")


def snapshot_from_meta(meta: dict, buf: torch.Tensor, nbytes: int, digest: int) -> Snapshot:
    """A received snapshot; ValueError when its entries do not fit its `nbytes`."""
    entries = [Entry(k, d, tuple(g), tuple(o), tuple(s), st, n, bool(r))
               for k, d, g, o, s, st, n, r in meta["entries"]]
    if any(e.start < 0 or e.nbytes < 0 or e.start + e.nbytes > nbytes for e in entries):
        raise ValueError("a replica whose entries lie outside its bytes")
    return Snapshot(meta["rank"], meta["world"], meta["step"], entries, meta["leaves"], buf,
                    nbytes, digest, extra=meta.get("extra") or {})


@dataclass
class ReplicaStats:
    """Counters: snapshots sent, snapshots that had to wait for the previous one's send,
    replicas received and rejected (checksum), seconds spent on the training thread (copying,
    waiting), bytes per snapshot."""

    sent: int = 0
    waits: int = 0
    received: int = 0
    rejected: int = 0
    copy_s: float = 0.0
    waited_s: float = 0.0  # the training thread waiting for the previous snapshot's send
    bytes: int = 0
    every: int = 1  # the interval in steps (chosen, with RESILIENT_REPLICA_EVERY=0)
    send_s: float = 0.0  # the last send's seconds (checksum and every buddy)
    errors: list[str] = field(default_factory=list)


class PeerReplicas:
    """Background replication of this rank's model and optimizer shards to peers' host memory.

    Collective to create (over the default group): it gathers the hosts and creates a gloo
    group of its own. ``replicate(step)`` after each ``optimizer.step()``; ``close()`` at the
    end. After a failure, pass it to ``resilient.recovery.reshard.restore_sharded`` on the new
    group.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 factor: int | None = None, memory_bytes: int | None = None,
                 every: int | None = None, send_timeout_s: float | None = None,
                 host: str | None = None, timeout_s: float = 86400.0,
                 group: Any = None, wait: Callable[[Any], None] | None = None) -> None:
        from resilient.checkpoint.exchange import host_id

        every = int(settings.get("replica_every") if every is None else every)
        if every < 0:
            raise ValueError(f"replica every must be >= 0 (0: chosen), not {every}")
        self.model, self.optimizer = model, optimizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        factor = settings.get("replica_factor") if factor is None else factor
        self.factor = int(factor)
        self.memory_bytes = (settings.get("replica_memory") if memory_bytes is None
                             else memory_bytes)
        self.auto = every == 0
        self.every = max(1, every)
        self._wait_fn = wait or _wait
        self._scheduled = 0  # snapshots due so far on this ring (the same count on every rank)
        self._calibrating = False  # the last agreement found a send running: agree again
        self._queued_at = 0.0  # when the snapshot being sent was handed to the sender
        self._next: int | None = None  # auto: the step the next snapshot is due at
        self._last: tuple[int, float] | None = None  # auto: the last snapshot's step, and when
        # replicate() returned (the training time since is the steps' own)
        self.send_timeout_s = float(settings.get("recovery_group_timeout_s")
                                    if send_timeout_s is None else send_timeout_s)
        self.broken: str | None = None  #: why replication stopped (None while it runs)
        # buffers (parameters excluded) are left out of the finiteness check
        params = {n for n, _ in model.named_parameters()}
        self._constant = frozenset(json.dumps(["model", n]) for n, _ in model.named_buffers()
                                   if n not in params)
        # a gloo group over every rank, for the replicas only (`group`: one created by the
        # caller with a long timeout, e.g. the restore's: a receiver waits for the next send)
        self._group = group if group is not None else replica_group(timeout_s)
        # `wait`: how the gather's collectives are waited for (Recovery polls them: the group's
        # timeout is long)
        self._backend = self._group._get_backend(torch.device("cpu"))
        hosts = gather_objects(host or host_id(), self._group, wait or _wait)
        plan = buddies([str(h) for h in hosts], factor)
        self.to = plan[self.rank]
        self.sources = [r for r in range(self.world) if self.rank in plan[r]]
        self.stats = ReplicaStats(every=self.every)
        self._lock = threading.Lock()
        self._own: list[Snapshot] = []
        self._held: dict[int, list[Snapshot]] = {r: [] for r in self.sources}
        self._spare: dict[int, torch.Tensor | None] = {r: None for r in self.sources}
        self._sent = threading.Condition(self._lock)
        self._queue: queue.Queue = queue.Queue()  # one snapshot at a time (_sending)
        self._sending = False
        self._stopped = False
        self._stream = None
        self._hook = optimizer.register_step_pre_hook(self._wait_copy)
        self._threads = [threading.Thread(target=self._send_loop, daemon=True,
                                          name="resilient-replica-send")]
        self._threads += [threading.Thread(target=self._receive_loop, args=(r,), daemon=True,
                                           name=f"resilient-replica-recv-{r}")
                          for r in self.sources]
        for t in self._threads:
            t.start()

    # --- the training thread -------------------------------------------------------------

    def replicate(self, step: int, extra: dict | None = None) -> bool:
        """Snapshots the state of `step` (and `extra`, JSON-able values that travel with it: a
        scheduler's state_dict, data positions) and hands it to the sender, when a snapshot is
        due at `step`; waits first for the previous snapshot's send. False when no snapshot was
        taken (not a due step, the interval's agreement found a send still running, or
        replication stopped: ``broken``).

        The schedule advances alike on every rank, whether its replication broke or not: a
        rank whose send failed still takes part in the interval's agreement, so the others
        never wait for it there."""
        if self._stopped or not self._due(step):
            return False
        if not self.to:
            if self.factor > 0 or self.broken:  # a group of one: nothing to restore for
                return False
            # RESILIENT_REPLICA_FACTOR=0 (HSDP: the other replica groups hold each shard): the
            # own snapshot is all, read by a restore that takes the lost shard's boxes from it
            self._take(step).extra = dict(extra or {})
            return True
        t0 = time.monotonic()
        calibrate = self.auto and (self._calibrating or self._scheduled % RECALIBRATE == 1)
        self._scheduled += 1
        try:
            if calibrate:
                self._calibrating = self._agree_interval(step, t0)
                if self._calibrating:  # a send still running somewhere: every rank skips this
                    return False  # snapshot rather than wait, and agrees again when next due
            with self._lock:
                if self._sending and not self.broken:
                    self.stats.waits += 1  # counted: how often the send was the bottleneck
                    done = self._sent.wait_for(lambda: not self._sending or self._stopped,
                                               timeout=self.send_timeout_s)
                    if not done:
                        self._break(f"the snapshot before step {step} was not sent within "
                                    f"{self.send_timeout_s:g} s")
                if self.broken or self._stopped:
                    return False
                self._sending = True
            self.stats.waited_s += time.monotonic() - t0
            t1 = time.monotonic()
            try:
                snap = self._take(step)
                snap.extra = dict(extra or {})
                snap.meta()  # a value that cannot travel fails here, on the training thread
            except BaseException:
                with self._lock:
                    self._sending = False
                    self._sent.notify_all()
                raise
            self.stats.copy_s += time.monotonic() - t1
            with self._lock:
                self._queued_at = time.monotonic()
            self._queue.put(snap)
            return True
        finally:
            if self.auto:
                self._next = step + self.every
                self._last = (step, time.monotonic())

    def _due(self, step: int) -> bool:
        if not self.auto:
            return step % self.every == 0
        return self._next is None or step >= self._next

    def _agree_interval(self, step: int, arrived: float) -> bool:
        """RESILIENT_REPLICA_EVERY=0: the interval from the slowest rank's send and training
        time per step since the last due step (collective over the replicas' group; every rank
        calls it at the same due step). A send still running counts with the time it has run
        so far. Returns whether one was still running on any rank (the snapshot is skipped and
        the agreement repeated at the next due step, with a longer interval)."""
        assert self._last is not None
        last_step, left = self._last
        step_s = max(arrived - left, 0.0) / max(step - last_step, 1)
        with self._lock:
            running = self._sending and not self.broken
            send_s = arrived - self._queued_at if running else self.stats.send_s
        t = torch.tensor([send_s, step_s, float(running)], dtype=torch.float64)
        self._wait_fn(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group,
                                      async_op=True))
        send_s, step_s, any_running = t.tolist()
        self.every = choose_every(send_s, step_s)
        self.stats.every = self.every
        return any_running > 0

    def snapshot_now(self, step: int, extra: dict | None = None) -> None:
        """Takes a snapshot of the current state (`step`) for a restore that follows at once,
        and sends nothing: a member's state when a joiner grows the group (the newest replica
        may be older: ``every``). Whatever the schedule, even with nobody to send to."""
        snap = self._take(step, reuse=False)  # both earlier snapshots stay restorable
        snap.extra = dict(extra or {})
        if snap.ready is not None:  # the restore frees the old state right after
            snap.ready.synchronize()

    # Point-to-point on the group's backend itself, not through torch.distributed's registry: a
    # script's destroy_process_group() unregisters the group before Recovery closes at exit,
    # and close() must still tell the buddies to stop (their receivers end instead of blocking
    # while the interpreter exits, which aborts it).
    def _send(self, t: torch.Tensor, dst: int) -> None:
        self._backend.send([t], dst, 0).wait()

    def _recv(self, t: torch.Tensor, src: int) -> None:
        self._backend.recv([t], src, 0).wait()

    def _break(self, why: str) -> None:
        """Replication stops (called with the lock held or not): logged once; a restore then
        finds no newer step here and falls back to storage."""
        if self.broken is None:
            self.broken = why
            self.stats.errors.append(why)
            if self._stopped:  # a send that the group's end (a recovery, a join) cut short
                log.info("resilient: peer replication on rank %d ended: %s", self.rank, why)
            else:
                log.error("resilient: peer replication on rank %d stopped: %s", self.rank, why)

    def _take(self, step: int, reuse: bool = True) -> Snapshot:
        tensors, leaves = flatten(state_of(self.model, self.optimizer))
        entries, locals_, nbytes = layout(tensors)
        self._check_budget(nbytes)
        cuda = any(t.is_cuda for t in locals_)
        with self._lock:
            # the older of the two own snapshots is reused; the newer one stays restorable
            old = self._own.pop(0) if reuse and len(self._own) == 2 else None
        buf = old.buf if old is not None and old.buf.numel() >= nbytes else None
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        snap = Snapshot(self.rank, self.world, step, entries, leaves, buf, nbytes)
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for e, t in zip(entries, locals_):
                    entry_tensor(buf, e).copy_(t, non_blocking=True)
                    if t.is_cuda:  # a state freed before the copy ran (a recovery drops the
                        t.record_stream(self._stream)  # old one) is not reused until it has
                snap.ready = torch.cuda.Event()
                snap.ready.record(self._stream)
        else:
            for e, t in zip(entries, locals_):
                entry_tensor(buf, e).copy_(t)
        with self._lock:
            self._own.append(snap)
        self.stats.bytes = nbytes
        return snap

    def _check_budget(self, nbytes: int) -> None:
        need = memory_needed(nbytes, len(self.sources))
        if self.memory_bytes and need > self.memory_bytes:
            raise MemoryError(
                f"peer replicas need {need / 2**30:.2f} GiB of host memory on rank {self.rank} "
                f"(two snapshots of its own {nbytes / 2**30:.2f} GiB state and three buffers for "
                f"each of {len(self.sources)} peers'), over RESILIENT_REPLICA_MEMORY "
                f"({self.memory_bytes / 2**30:.2f} GiB)")

    def _wait_copy(self, *_: Any) -> None:
        """Optimizer step pre-hook: the update waits (on the GPU) for the snapshot's copy."""
        with self._lock:
            newest = self._own[-1] if self._own else None
        if newest is not None and newest.ready is not None:
            torch.cuda.current_stream().wait_event(newest.ready)

    # --- threads ------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            snap = self._queue.get()
            if snap is None:  # stop: the buddies' receivers end too (a dead buddy: no matter)
                self._send_stop()
                return
            try:
                if snap.ready is not None:
                    snap.ready.synchronize()
                t_digest = time.monotonic()
                snap.digest = _digest(snap.buf, snap.nbytes)
                snap.digest_s = time.monotonic() - t_digest
                snap.state = "ok"
                meta = torch.frombuffer(bytearray(snap.meta()), dtype=torch.uint8)
                header = torch.tensor([_MAGIC, snap.step, snap.nbytes, _signed(snap.digest),
                                       meta.numel(), self.rank, self.world], dtype=torch.int64)
                t0 = time.monotonic()  # with the checksum: the send's time is the sender's
                for b in self.to:
                    self._send(header, b)
                    self._send(meta, b)
                    self._send(snap.buf[:snap.nbytes], b)
                self.stats.send_s = time.monotonic() - t0 + snap.digest_s
                self.stats.sent += 1
            except Exception as e:  # a peer that died: recovery rebuilds the ring
                self._break(f"send: {e}")
                return
            finally:
                with self._lock:
                    self._sending = False
                    self._sent.notify_all()

    def _send_stop(self) -> None:
        header = torch.tensor([_MAGIC, -1, 0, 0, 0, self.rank, self.world], dtype=torch.int64)
        for b in self.to:
            try:
                self._send(header, b)
            except Exception:
                pass

    def _receive_loop(self, src: int) -> None:
        while True:
            try:
                header = torch.empty(_HEADER, dtype=torch.int64)
                self._recv(header, src)
                magic, step, nbytes, digest, meta_len, rank, _world = header.tolist()
                if magic != _MAGIC or rank != src:
                    raise RuntimeError(f"a stray message from rank {src}: header {header.tolist()}")
                if step < 0:  # the sender stopped
                    return
                meta_t = torch.empty(meta_len, dtype=torch.uint8)
                self._recv(meta_t, src)
                meta = json.loads(bytes(meta_t.numpy()))
                with self._lock:
                    stopped = self._stopped
                    held = self._held[src]
                    buf = None
                    if not stopped:
                        buf, self._spare[src] = self._spare[src], None
                if stopped:  # drained until the sender's stop, which close() awaits
                    self._recv(torch.empty(max(nbytes, 1), dtype=torch.uint8)[:nbytes], src)
                    continue
                if buf is None or buf.numel() < nbytes:  # a third buffer: the two verified
                    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)  # replicas stay
                self._recv(buf[:nbytes], src)
                snap = snapshot_from_meta(meta, buf, nbytes, digest % (1 << 64))
                ok = step == meta["step"] and _digest(buf, nbytes) == snap.digest
                snap.state = "ok" if ok else "bad"
                with self._lock:
                    if ok:
                        held.append(snap)
                        self.stats.received += 1
                        if len(held) > 2:
                            self._spare[src] = held.pop(0).buf
                    else:
                        self._spare[src] = buf
                        self.stats.rejected += 1
            except Exception as e:
                if not self._stopped:
                    log.warning("resilient: rank %d stopped receiving replicas from rank %d: %s",
                                self.rank, src, e)
                    with self._lock:
                        self.stats.errors.append(f"receive from {src}: {e}")
                return

    # --- restore and shutdown -----------------------------------------------------------

    def holdings(self) -> list[Snapshot]:
        """The verified snapshots held here (own and peers'), newest first per rank. Stops the
        replication first: what a restore reads no longer changes."""
        self.stop()
        with self._lock:
            own = list(self._own)
            held = [s for v in self._held.values() for s in v]
        for s in own:  # a snapshot taken but not yet checksummed by the sender: complete now
            if s.state == "writing":
                if s.ready is not None:
                    s.ready.synchronize()
                s.digest = _digest(s.buf, s.nbytes)
                s.state = "ok"
        out = []
        for s in own + held:
            if s.verify(self._constant):
                out.append(s)
            else:
                self.stats.rejected += 1
        return out

    def stop(self) -> None:
        """Ends replication (threads blocked on a dead peer are left behind: daemon threads)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._sent.notify_all()
        self._hook.remove()
        self._queue.put(None)

    @property
    def sending(self) -> bool:
        """Whether a snapshot is being sent to the buddies now."""
        with self._lock:
            return self._sending

    def drain(self, step: int, timeout_s: float = 60.0) -> None:
        """Waits until this rank's snapshot of `step` (or a later one) was sent and a replica of
        `step` or later from every peer it backs up arrived; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                sent = not self._sending and any(s.step >= step and s.state == "ok"
                                                 for s in self._own)
                got = all(any(s.step >= step for s in v) for v in self._held.values())
                errors = list(self.stats.errors)
            if errors:
                raise RuntimeError(f"peer replication failed: {errors}")
            if (sent or not self.to) and got:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replicas of step {step} not complete after {timeout_s} s on rank "
                    f"{self.rank}: own steps {[x.step for x in self._own]}, held "
                    f"{ {r: [x.step for x in v] for r, v in self._held.items()} }, {self.stats}")
            time.sleep(0.005)

    def release(self) -> None:
        """Drops the snapshots (after a restore took what it needed)."""
        self.stop()
        with self._lock:
            self._own, self._held = [], {r: [] for r in self.sources}
            self._spare = {r: None for r in self.sources}

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops replication: the sender finishes its snapshot and tells its buddies, and the
        receivers take what their sources still send until those stop. Every rank calls it (a
        thread left blocked in gloo at exit aborts the interpreter); bounded by `timeout_s`."""
        self.stop()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def choose_every(send_s: float, step_s: float) -> int:
    """Steps between snapshots so that a send of ``send_s`` seconds fits, with :data:`MARGIN`,
    in that many steps of ``step_s`` (1 .. :data:`MAX_EVERY`)."""
    if step_s <= 0.0:
        return MAX_EVERY if send_s > 0.0 else 1
    return max(1, min(MAX_EVERY, math.ceil(MARGIN * send_s / step_s - 1e-9)))


def _wait(work: Any) -> None:
    work.wait()


def gather_objects(obj: Any, group: Any, wait: Callable[[Any], None] = _wait) -> list[Any]:
    """``all_gather_object`` as two asynchronous all-gathers (sizes, then the padded bytes),
    each waited for by `wait` (Recovery's polls them against the detector's verdict)."""
    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    wait(dist.all_gather(sizes, torch.tensor([data.numel()]), group=group, async_op=True))
    n = max(int(t) for t in sizes)
    padded = torch.zeros(n, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.empty(n, dtype=torch.uint8) for _ in range(world)]
    wait(dist.all_gather(parts, padded, group=group, async_op=True))
    return [pickle.loads(p[:int(k)].numpy().tobytes())  # noqa: S301 -- the job's own ranks
            for p, k in zip(parts, sizes)]


def replica_group(timeout_s: float = 86400.0, rendezvous_s: float | None = None) -> Any:
    """A gloo group over every rank of the default group, for PeerReplicas (collective).

    Its operations wait up to `timeout_s` (long: a receiver waits for the next send; gloo's
    point-to-point waits keep the timeout the group was created with). Every rank first checks
    in on the default group's store and waits at most `rendezvous_s` (default
    ``RESILIENT_RECOVERY_GROUP_TIMEOUT_S``, the bound of the default group's creation) for the
    others, so a peer lost before the group's creation fails it (the next recovery follows)
    instead of blocking for `timeout_s`."""
    from torch.distributed import distributed_c10d

    rendezvous = float(settings.get("recovery_group_timeout_s") if rendezvous_s is None
                       else rendezvous_s)
    store = distributed_c10d._get_default_store()  # the current group's (generation's) keys
    world = dist.get_world_size()
    # every rank of one default group creates its replica groups in the same order
    if _created[0] is not dist.group.WORLD:
        _created[:] = [dist.group.WORLD, 0]
    key = f"resilient-replica-group/{_created[1]}"
    _created[1] += 1
    if int(store.add(key, 1)) == world:  # the last to arrive tells the others (one wait
        store.set(f"{key}/all", b"1")     # each, not a poll of the store by every rank)
    try:
        store.wait([f"{key}/all"], timedelta(seconds=rendezvous))
    except Exception as e:  # noqa: BLE001 -- the store's timeout (or its loss): one message
        try:
            arrived: Any = int(store.add(key, 0))
        except Exception:  # noqa: BLE001 -- the store itself is gone
            arrived = "not every one"
        raise dist.DistStoreError(f"the replicas' group: {arrived} of {world} ranks arrived "
                                  f"within {rendezvous:g} s") from e
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


#: the default group and how many replica groups were made over it (the store's key names)
_created: list[Any] = [None, 0]


def memory_needed(nbytes: int, sources: int) -> int:
    """Host bytes for two own snapshots and three buffers (two replicas and one arriving) for
    each of `sources` peers."""
    return nbytes * (2 + 3 * sources)


__all__ = ["Entry", "PeerReplicas", "ReplicaStats", "Snapshot", "buddies", "flatten",
           "gather_objects", "layout", "memory_needed", "replica_group", "state_of"]
