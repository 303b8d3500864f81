"""The ranks one checkpointer spans, and the few collectives it needs between them.

One process (no torch.distributed, or ``distributed=False``) is the case of one rank: gathers
return the caller's own object and the store is an in-process HashStore, so the save, commit and
load code is the same for 1 and N ranks. With N ranks, small objects travel over a gloo group
and the commit protocol's reports over the job's store.

Every collective call of a checkpointer first *enters*: each rank adds itself to a counter in
the store and waits until every rank is in. A rank that waits longer than
``collective_timeout`` (default 30 s) raises CollectiveError saying how many ranks arrived,
instead of blocking in gloo for the process group's timeout (the usual cause is a save guarded
by ``if rank == 0``). The entry also checks that every rank passed the same step: the first
rank in leaves its argument in the store and every later one compares its own with it; one
that differs marks the entry broken and raises without counting itself in, so every other rank
raises while it waits. A rank makes the same few store calls whatever the world size.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resilient import settings
from resilient.errors import CollectiveError


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
        self._aborted: tuple[int, str] | None = None  # (entry seq, reason): abort()
        self.broken = ""
        if not self.distributed:
            self.rank, self.world_size, self.group = 0, 1, None
            self.store = store if store is not None else dist.HashStore()
            self.run_id = os.urandom(6).hex()
            return
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = (group if group is not None
                      else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)))
        self.store = store if store is not None else default_store()
        run = [os.urandom(6).hex() if self.rank == 0 else None]
        dist.broadcast_object_list(run, src=0, group=self.group)
        self.run_id = run[0]

    def gather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's `obj` (small control objects, pickled as all_gather_object does), in
        two gloo all-gathers that are polled, not waited on: abort() ends them. `timeout`:
        for a collective that some rank enters late on purpose (default collective_timeout)."""
        if not self.distributed:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(dist.all_gather(sizes, torch.tensor([data.numel()]), group=self.group,
                                   async_op=True), timeout)
        n = max(int(x) for x in sizes)
        mine = torch.zeros(n, dtype=torch.uint8)
        mine[:data.numel()] = data
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))
        return [pickle.loads(o[:int(x)].numpy().tobytes()) for o, x in zip(out, sizes)]

    def broadcast(self, obj: Any, timeout: float | None = None) -> Any:
        """Rank 0's `obj` on every rank."""
        return self.gather(obj if self.rank == 0 else None, timeout)[0]

    def _wait(self, work: Any, timeout: float | None = None) -> None:
        """Waits for a gloo collective by polling it: a peer killed mid-collective can leave a
        survivor blocked in gloo (its neighbours gave up on the collective but their connections
        stay open) until the group's timeout; abort() (the detector's verdict) ends it at once,
        and so does the store's mark of another rank's abort."""
        limit = self.collective_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        polls = 0
        while not work.is_completed():
            aborted = self._aborted
            if aborted is not None and aborted[0] >= self._seq - 1:
                self.broken = f"aborted: {aborted[1]}"
                raise CollectiveError(f"checkpoint collective abandoned: {aborted[1]}")
            polls += 1
            if polls % 50 == 0 and self.store.check(
                    [f"resilient/ckpt/{self.run_id}/enter/{self._seq}/broken"]):
                self.broken = "a peer gave up"
                raise CollectiveError(
                    self.store.get(f"resilient/ckpt/{self.run_id}/enter/{self._seq}/broken")
                    .decode())
            if time.monotonic() > deadline:
                self.broken = "a collective timed out"
                raise CollectiveError(f"a checkpoint collective did not finish within "
                                      f"{limit:g} s")
            # A gather on a healthy group takes well under a millisecond: back off from 50 us,
            # so polling adds little to the save's stall, to 2 ms while it waits longer.
            time.sleep(min(0.002, 0.00005 * (1 << min(polls, 6))))
        try:
            work.wait()
        except RuntimeError as e:  # gloo's own error: a peer closed its connection
            self.broken = "a collective failed"
            raise CollectiveError(f"a checkpoint collective failed (a peer is gone?): "
                                  f"{str(e).splitlines()[0][:300]}") from e

    def abort(self, reason: str) -> None:
        """Makes the collective entry in progress (or the next one) raise CollectiveError on
        every rank at once instead of after ``collective_timeout``, and ends a gather of it that
        waits for a lost peer: for in-process recovery, whose detector knows a peer is gone.
        Safe from another thread."""
        if not self.distributed:
            return
        self._aborted = (self._seq, reason)
        for seq in (self._seq, self._seq + 1):
            self.store.set(f"resilient/ckpt/{self.run_id}/enter/{seq}/broken", reason)

    def enter(self, op: str, arg: Any) -> None:
        """Collective entry check (module docstring). Raises CollectiveError on every rank that
        entered when some rank did not come within collective_timeout, or came with another
        `arg`."""
        if not self.distributed:
            return
        if self.broken:
            raise CollectiveError(f"this checkpointer is out of step with its peers after an "
                                  f"earlier error ({self.broken}); close it and create a new one")
        self._seq += 1
        prefix = f"resilient/ckpt/{self.run_id}/enter/{self._seq}"
        broken = f"{prefix}/broken"  # set by a rank that gave up: late arrivals give up too
        # A constant number of store calls per rank, whatever the world size: the first rank in
        # leaves its argument, each later one reads it back in the same call.
        mine = json.dumps([self.rank, arg])
        other_rank, other = json.loads(self.store.compare_set(f"{prefix}/arg", "", mine))
        if json.dumps(other) != json.dumps(arg):
            # Raise without counting in: the count never completes, so every other rank sees
            # `broken` while it waits and raises too, before anything else happens.
            verdict = json.dumps({other_rank: other, self.rank: arg})
            self.broken = f"{op}({arg!r}): {verdict[:200]}"
            message = (f"{op}() was called with different arguments on different ranks "
                       f"(rank: argument): {verdict}")
            self.store.compare_set(broken, "", message)
            raise CollectiveError(message)
        arrived = self.store.add(f"{prefix}/count", 1)
        deadline = time.monotonic() + self.collective_timeout
        delay = 0.0002
        while arrived < self.world_size:
            if self.store.check([broken]):
                self.broken = f"{op}({arg!r}): a peer gave up"
                raise CollectiveError(self.store.get(broken).decode())
            if time.monotonic() >= deadline:
                self.broken = f"{op}({arg!r}) entered by {arrived} of {self.world_size} ranks"
                self.store.set(broken, f"{op}() is collective and rank {self.rank} gave up "
                               f"waiting for the others ({self.broken})")
                raise CollectiveError(
                    f"{op}() is collective: every rank of the process group must call it (rank "
                    f"{self.rank} called {op}({arg!r}), but only {arrived} of {self.world_size} "
                    f"ranks did within {self.collective_timeout:g} s; a call guarded by `if rank "
                    "== 0` does this; for a checkpoint written by one process pass "
                    "distributed=False)")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
            arrived = self.store.add(f"{prefix}/count", 0)
        if self.store.check([broken]):  # a rank gave up as the count completed
            self.broken = f"{op}({arg!r}): a peer gave up"
            raise CollectiveError(self.store.get(broken).decode())
        if self.rank == 0 and self._seq > 1:  # keep the job's store small over many calls
            old = f"resilient/ckpt/{self.run_id}/enter/{self._seq - 1}"
            for key in (f"{old}/count", f"{old}/arg", f"{old}/broken"):
                try:
                    self.store.delete_key(key)
                except Exception:
                    pass
