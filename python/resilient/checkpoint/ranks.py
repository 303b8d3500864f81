"""The ranks one checkpointer spans, and the few collectives it needs between them.

One process (no torch.distributed, or ``distributed=False``) is the case of one rank: gathers
return the caller's own object and the store is an in-process HashStore, so the save, commit and
load code is the same for 1 and N ranks. With N ranks, small objects travel over a gloo group
and the commit protocol's reports over the job's store.

Every collective call of a checkpointer first *enters*: each rank counts itself in (one store
call, not waited on) and the operation and its argument ride along with its first gather, after
which every rank compares them: a rank that called another operation, or the same with another
argument (a different step), makes every rank raise CollectiveError naming each rank's call. A
gather that waits longer than ``collective_timeout`` (default 30 s) raises CollectiveError saying
how many ranks arrived, instead of blocking in gloo for the process group's timeout (the usual
cause is a save guarded by ``if rank == 0``); a rank that gives up, or aborts, poisons the
entry's count, so one that enters it later raises at once. ``enter(..., check=True)`` compares
the calls before the caller does anything (saves until one made the root; every load). A rank
makes the same few store calls whatever the world size.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import pickle
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resilient import settings
from resilient.detect import own_connection
from resilient.errors import CollectiveError

# A gather's first round carries this many bytes per rank (an 8-byte length, then the pickled
# object); a larger object takes a second round, after which the slot grows to fit such objects
# in one round, up to _SLOT_MAX, and to no more than _ROUND_MAX bytes over all ranks (every
# gather moves world_size slots, however small its objects).
_SLOT_MIN, _SLOT_MAX, _ROUND_MAX = 1024, 64 << 10, 4 << 20
# Added to an entry's count by a rank that gave up on it (timeout, abort): a rank that enters it
# later sees a count this large and raises, instead of meeting the abandoned all-gather, which
# stays posted in gloo until the group's timeout.
_POISON = 1 << 32


def grown_slot(slot: int, n: int, world_size: int) -> int:
    """The slot after a gather whose largest object took `n` bytes (beyond the 8-byte length):
    the next power of two that fits it, never smaller than `slot`, never more than _SLOT_MAX per
    rank or _ROUND_MAX over all ranks (but at least _SLOT_MIN)."""
    limit = max(_SLOT_MIN, min(_SLOT_MAX, _ROUND_MAX // max(1, world_size)))
    return max(slot, min(limit, 1 << (n + 8 - 1).bit_length()))


def wait_key(store: Any, key: str, timeout: float, poll_s: float = 0.005,
             abort: str | None = None) -> None:
    """Waits until `key` is set in `store`, polling with check(): a blocking store.wait() holds
    the TCPStore client's connection for its whole duration, so the commit thread's wait would
    stall the main thread's store calls (and the other way round). TimeoutError when late;
    CollectiveError as soon as the key `abort` is set."""
    deadline = time.monotonic() + timeout
    delay = min(poll_s, 0.001)
    while not store.check([key]):
        if abort is not None and store.check([abort]):
            raise CollectiveError(store.get(abort).decode())
        if time.monotonic() >= deadline:
            raise TimeoutError(f"store key {key!r} not set within {timeout:g} s")
        time.sleep(delay)
        delay = min(delay * 2, poll_s)


# give_up() of the innermost abandon_when() on this thread (and its context), or None.
_GIVE_UP: contextvars.ContextVar[Callable[[], str | None] | None] = contextvars.ContextVar(
    "resilient_ckpt_give_up", default=None)


@contextlib.contextmanager
def abandon_when(give_up: Callable[[], str | None]) -> Iterator[None]:
    """Within the block, every checkpoint collective this thread waits for (a checkpointer's
    creation included, whose Ranks no abort() can reach yet) also ends with CollectiveError as
    soon as ``give_up()`` returns a reason: in-process recovery passes "a newer verdict removed
    a member of the group", so moving the checkpointer onto a rebuilt group never waits for a
    peer lost meanwhile (asked every 10 ms, in the polls' own loop)."""
    token = _GIVE_UP.set(give_up)
    try:
        yield
    finally:
        _GIVE_UP.reset(token)


def _given_up() -> str | None:
    give_up = _GIVE_UP.get()
    return give_up() if give_up is not None else None


def default_store() -> Any:
    """The store of the default process group (torchrun's or init_process_group's)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class Ranks:
    """rank, world_size, gather(obj), broadcast(obj), enter(op, arg) and a store."""

    def __init__(
        self,
        distributed: bool | None,
        group: Any,
        store: Any,
        timeout: float,
        collective_timeout: float | None,
    ):
        if distributed is None:
            distributed = dist.is_available() and dist.is_initialized() and (
                dist.get_world_size() > 1)
        if distributed and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("a distributed checkpointer needs "
                               "torch.distributed.init_process_group() first")
        self.distributed = bool(distributed)
        if collective_timeout is None:
            collective_timeout = settings.get("RESILIENT_COLLECTIVE_TIMEOUT_S")
        self.collective_timeout = float(collective_timeout)
        self._seq = 0
        self._entry: tuple[str, Any] | None = None  # (op, arg) of the collective in progress
        self._unchecked = False  # its first gather still has to compare every rank's entry
        self._slot = _SLOT_MIN  # bytes per rank of a gather's first round (the same on all)
        self._aborted: tuple[int, str] | None = None  # (entry seq, reason): abort()
        self.broken = ""
        self._retired = False  # the group went to the graveyard (retire())
        if not self.distributed:
            self.rank, self.world_size, self.group = 0, 1, None
            self.store = store if store is not None else dist.HashStore()
            self.run_id = os.urandom(6).hex()
            return
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = (group if group is not None
                      else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)))
        # the default group's store over a connection of its own: a gloo group connecting
        # lazily waits on its connection for a peer's address, which would stall these polls
        self.store = store if store is not None else own_connection(default_store())
        # rank 0's run id, by a polled broadcast (abandon_when() ends it; the store's marks
        # are keyed by the id, so none exist yet)
        run = torch.zeros(6, dtype=torch.uint8)
        if self.rank == 0:
            run.copy_(torch.frombuffer(bytearray(os.urandom(6)), dtype=torch.uint8))
        try:
            work = dist.broadcast(run, group=self.group, group_src=0, async_op=True)
            deadline = time.monotonic() + timeout
            while not work.is_completed():
                why = _given_up()
                if why or time.monotonic() > deadline:
                    raise CollectiveError(f"creating the checkpointer's ranks: "
                                          f"{why or f'rank 0 not heard within {timeout:g} s'}")
                time.sleep(0.001)
            work.wait()
        except RuntimeError as e:  # gloo's own error: a peer died before or while connecting
            self.retire()
            raise CollectiveError(f"creating the checkpointer's ranks failed (a peer is gone?): "
                                  f"{str(e).splitlines()[0][:300]}") from e
        except BaseException:
            self.retire()
            raise
        self.run_id = run.numpy().tobytes().hex()

    def gather(self, obj: Any, timeout: float | None = None, fit: bool = False) -> list[Any]:
        """Every rank's `obj` (small control objects, pickled as all_gather_object does), in
        one gloo all-gather of a fixed slot per rank, and a second one only when some rank's
        object does not fit; polled, not waited on: abort() ends them. `timeout`: for a
        collective that some rank enters late on purpose (default collective_timeout). `fit`:
        grow the slot to fit this gather's objects (a gather made at every save, whose size is
        the steady state; not a one-off large one). The first gather after enter() also
        compares every rank's entry (module docstring)."""
        if not self.distributed:
            return [obj]
        entry = self._entry if self._unchecked else None
        self._unchecked = False
        data = pickle.dumps((entry, obj), protocol=pickle.HIGHEST_PROTOCOL)
        slot = self._slot
        first = len(data).to_bytes(8, "little") + data[:slot - 8]
        mine = torch.zeros(slot, dtype=torch.uint8)
        mine[:len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        out = [torch.empty(slot, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, mine, group=self.group, async_op=True), timeout)
        sizes = [int.from_bytes(o[:8].numpy().tobytes(), "little") for o in out]
        n = max(sizes)
        if n <= slot - 8:
            blobs = [o[8:8 + k].numpy().tobytes() for o, k in zip(out, sizes)]
        else:  # every rank sees the same sizes, so every rank takes this branch
            mine = torch.zeros(n, dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True), timeout)
            blobs = [o[:k].numpy().tobytes() for o, k in zip(out, sizes)]
            if fit:  # every rank passes the same `fit` at the same gather
                self._slot = grown_slot(slot, n, self.world_size)
        items = [pickle.loads(b) for b in blobs]
        entries = [e for e, _ in items]
        if any(e != entries[0] for e in entries):
            self._differ(entries)
        return [o for _, o in items]

    def _differ(self, entries: list[Any]) -> None:
        """Raises on every rank (each saw the same entries) that the ranks called different
        operations, or one operation with different arguments."""
        calls = {r: (f"{e[0]}({e[1]!r})" if e else "no checkpoint operation")
                 for r, e in enumerate(entries)}
        ops = {e[0] if e else None for e in entries}
        op = entries[self.rank][0] if entries[self.rank] else "gather"
        verdict = json.dumps(calls)
        self.broken = f"{op}: {verdict[:200]}"
        if len(ops) == 1:
            raise CollectiveError(f"{op}() was called with different arguments on different "
                                  f"ranks (rank: call): {verdict}")
        raise CollectiveError(f"the ranks called different checkpoint operations at once "
                              f"(rank: call): {verdict}")

    def broadcast(self, obj: Any, timeout: float | None = None) -> Any:
        """Rank 0's `obj` on every rank."""
        return self.gather(obj if self.rank == 0 else None, timeout)[0]

    def wait(self, work: Any, timeout: float | None = None) -> None:
        """Waits for `work` (any process group's, NCCL's included; anything with
        is_completed() and wait()) as the gathers do: polled, ended by abort(), a peer's mark
        or `timeout` (default collective_timeout; CollectiveError)."""
        self._wait(work, timeout)

    def _wait(self, work: Any, timeout: float | None = None) -> None:
        """Waits for a gloo collective by polling it: a peer killed mid-collective can leave a
        survivor blocked in gloo (its neighbours gave up on the collective but their connections
        stay open) until the group's timeout; abort() (the detector's verdict) ends it at once,
        and so does the store's mark of another rank's abort. A collective given up on, or one
        that failed, retires the group (:meth:`retire`)."""
        try:
            self._poll(work, timeout)
        except BaseException:
            self.retire()
            raise

    def retire(self) -> None:
        """Hands the group to resilient.comm's graveyard: its gloo worker may still wait in a
        collective for a lost or frozen peer, and the group's destructor joins that worker, so
        the group must never be destroyed on the caller's thread (the last reference to it may
        go with this checkpointer, or with an exception's traceback) or at exit. Idempotent."""
        if self.group is not None and not self._retired:
            from resilient.comm.process_group import retire_groups

            self._retired = True
            retire_groups([self.group])

    def _poll(self, work: Any, timeout: float | None) -> None:
        limit = self.collective_timeout if timeout is None else timeout
        start = time.monotonic()
        deadline, next_check, next_give_up = start + limit, start + 0.1, start
        polls = 0
        while not work.is_completed():
            aborted = self._aborted
            if aborted is not None and aborted[0] >= self._seq - 1:
                self.broken = f"aborted: {aborted[1]}"
                raise CollectiveError(f"checkpoint collective abandoned: {aborted[1]}")
            polls += 1
            now = time.monotonic()
            if now >= next_give_up:  # abandon_when()'s reason, every 10 ms
                next_give_up = now + 0.01
                why = _given_up()
                if why:
                    self.broken = f"abandoned: {why}"
                    raise CollectiveError(f"checkpoint collective abandoned: {why}")
            if now >= next_check:  # the store, every 100 ms: at 1,000 ranks it is one server
                next_check = now + 0.1
                broken = self._key(self._seq, "broken")
                if self.store.check([broken]):
                    self.broken = "a peer gave up"
                    raise CollectiveError(self.store.get(broken).decode())
            if now > deadline:
                self._timed_out(limit)
            # Polling a local work object costs nothing but CPU: every 50 us (about 100 us with
            # the timer's slack) for the first 400 polls, 20-40 ms (a peer a few milliseconds
            # late is the common case in a save, and each poll's overshoot adds to the stall),
            # then every 2 ms.
            time.sleep(0.00005 if polls < 400 else 0.002)
        try:
            work.wait()
        except RuntimeError as e:  # gloo's own error: a peer closed its connection
            self.broken = "a collective failed"
            message = (f"a checkpoint collective failed (a peer is gone?): "
                       f"{str(e).splitlines()[0][:300]}")
            if self._entry is not None:  # the others stop too, not only where they meet it
                self._mark_broken(self._key(self._seq, "count"),
                                  self._key(self._seq, "broken"), message)
            raise CollectiveError(message) from e

    def abort(self, reason: str) -> None:
        """Makes the collective entry in progress (or the next one) raise CollectiveError on
        every rank at once instead of after ``collective_timeout``, and ends a gather of it that
        waits for a lost peer: for in-process recovery, whose detector knows a peer is gone.
        Safe from another thread."""
        if not self.distributed:
            return
        self._aborted = (self._seq, reason)
        self.retire()  # a gather in flight waits for the lost peer
        for seq in (self._seq, self._seq + 1):
            self.store.set(self._key(seq, "broken"), reason)
            self.store.add(self._key(seq, "count"), _POISON)

    def _timed_out(self, limit: float) -> None:
        """Raises CollectiveError for a gather that did not finish within `limit` seconds,
        saying how many ranks entered the operation in progress, and marks it broken in the
        store so that the others raise too."""
        self.broken = "a collective timed out"
        message = f"a checkpoint collective did not finish within {limit:g} s"
        if self._entry is not None:
            op, arg = self._entry
            count, broken = self._key(self._seq, "count"), self._key(self._seq, "broken")
            try:
                arrived = int(self.store.add(count, 0)) % _POISON
            except Exception:
                arrived = -1
            if arrived == self.world_size:
                self.broken = f"{op}({arg!r}): a step timed out"
                message = (f"{op}({arg!r}): a collective step did not finish within {limit:g} s "
                           f"on rank {self.rank}; every rank entered {op}(), so a peer stopped "
                           "(frozen, or its host is gone) or is slower than that")
            if 0 <= arrived < self.world_size:
                self.broken = f"{op}({arg!r}) entered by {arrived} of {self.world_size} ranks"
                message = (
                    f"{op}() is collective: every rank of the process group must call it (rank "
                    f"{self.rank} called {op}({arg!r}), but only {arrived} of {self.world_size} "
                    f"ranks did within {limit:g} s; a call guarded by `if rank == 0` does this; "
                    "for a checkpoint written by one process pass distributed=False)")
            self._mark_broken(count, broken, message)
        raise CollectiveError(message)

    def _mark_broken(self, count: str, broken: str, message: str) -> None:
        """Marks the entry broken in the store (why first, so that a rank the poison stops
        can read it), then poisons its count: every rank's polled wait raises."""
        try:
            self.store.compare_set(broken, "", f"rank {self.rank}: {message}")
            self.store.add(count, _POISON)
        except Exception:  # the store is gone: the others end by their own timeouts
            pass

    def _key(self, seq: int, leaf: str) -> str:
        """The job store's key `leaf` ("count" or "broken") of collective entry `seq`."""
        return f"resilient/ckpt/{self.run_id}/enter/{seq}/{leaf}"

    def enter(self, op: str, arg: Any, check: bool = False) -> None:
        """Collective entry (module docstring): counts this rank in; its next gather compares
        every rank's (op, arg), or now when `check`. Raises CollectiveError on every rank when
        a rank called another operation or argument, or (in that gather) when some rank did
        not come within collective_timeout. `arg` must be JSON-like and the same on every
        rank."""
        if not self.distributed:
            return
        if self.broken:
            raise CollectiveError(f"this checkpointer is out of step with its peers after an "
                                  f"earlier error ({self.broken}); close it and create a new one")
        self._seq += 1
        self._entry, self._unchecked = (op, arg), True
        aborted = self._aborted
        if aborted is not None and aborted[0] >= self._seq - 1:
            self.broken = f"aborted: {aborted[1]}"
            raise CollectiveError(f"checkpoint collective abandoned: {aborted[1]}")
        if self.store.add(self._key(self._seq, "count"), 1) >= _POISON:  # a peer gave up on it
            self.broken = f"{op}({arg!r}): a peer gave up"
            broken = self._key(self._seq, "broken")
            why = (self.store.get(broken).decode()
                   if self.store.check([broken]) else "a peer gave up on it")
            raise CollectiveError(f"{op}({arg!r}) was abandoned by another rank: {why}")
        if self.rank == 0 and self._seq > 1:  # keep the job's store small over many calls
            try:
                self.store.delete_key(self._key(self._seq - 1, "count"))
            except Exception:
                pass
        if check:
            self.gather(None)
