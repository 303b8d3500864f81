"""Reading checkpoints: assembling each tensor a rank holds from the saved pieces that overlap
it (plan.plan_reads), either reading those pieces directly from the shared checkpoint directory
(Reader.run) or reading each shard once and broadcasting it over a gloo group
(Reader.run_redistributed). A piece that lands whole on a contiguous target (CPU or CUDA) is read
straight into it; others go through a host buffer."""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from resilient import settings
from resilient.checkpoint import device_share, exchange, host_share, shm
from resilient.checkpoint.codec import dtype_from_name, dtype_name
from resilient.checkpoint.plan import Saved, ShardSpec, plan_reads
from resilient.errors import (
    CollectiveError,
    CorruptCheckpointError,
    ResilientError,
    VersionMismatchError,
)

log = logging.getLogger("resilient.checkpoint")


class Blocking:
    """The collectives of a collective read (``Reader.run_shared``, ``run_redistributed``)
    when no Checkpointer's ``Ranks`` (polled, abort-aware) carries them: blocking calls on
    `group`, bounded only by its own timeout."""

    def __init__(self, group: Any, world: int):
        self.group, self.world = group, world

    def gather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def wait(self, work: Any, timeout: float | None = None) -> None:
        work.wait()


class Wanted:
    """A tensor being assembled: `result()` after the reader ran."""

    def __init__(self, name: str, target: Any, dtype: str, shape: tuple[int, ...], copies: list):
        self.name, self.target, self.copies = name, target, copies
        if isinstance(target, torch.Tensor):
            self.out = target  # assembled in place
        elif isinstance(target, np.ndarray):
            self.out = torch.from_numpy(target)
        else:
            self.out = torch.empty(shape, dtype=dtype_from_name(dtype))

    def result(self) -> Any:
        if isinstance(self.target, torch.Tensor):
            return self.target
        return self.out


class Reader:
    """Collects the saved pieces a rank needs, reads them in one parallel native call, copies."""

    def __init__(self, engine: Any, manifest: Any, entries: dict[str, dict]):
        self._engine, self._manifest, self._entries = engine, manifest, entries
        self._wanted: list[Wanted] = []
        self._copies_of: dict[str, list[tuple[int, int]]] | None = None  # see _copy_out
        self.bytes_read = 0  # read from storage by this rank (the last run*)
        self.seconds: dict[str, float] = {}  # this rank's phases of the last run_shared

    def want(
        self,
        name: str,
        target: Any,
        dtype: str,
        shape: tuple[int, ...],
        spec: ShardSpec | None,
        pieces: list[Saved],
    ) -> Wanted:
        w = Wanted(name, target, dtype, shape, plan_reads(name, dtype, shape, spec, pieces))
        self._wanted.append(w)
        self._copies_of = None
        return w

    def run(self, only: set[str] | None = None) -> None:
        """Reads the pieces this rank needs (those in `only`, when given) from storage and puts
        them in place."""
        ptrs: dict[str, int] = {}  # entry -> where it is read to
        devices: dict[str, int] = {}  # entry -> CUDA device of a direct read
        direct: set[tuple[int, int]] = set()  # (wanted, copy) read straight into the target
        skip: set[tuple[int, int]] = set()  # (wanted, copy) not in `only`
        if only is not None:
            skip = {(i, j) for i, w in enumerate(self._wanted) for j, c in enumerate(w.copies)
                    if c.entry not in only}
        for i, w in enumerate(self._wanted):
            t = w.out
            if t.device.type not in ("cpu", "cuda") or not t.is_contiguous() or t.is_conj():
                continue
            for j, c in enumerate(w.copies):
                if (i, j) not in skip and c.entry not in ptrs and self._lands_whole(c, t):
                    offset = c.dst[0][0] * t.stride(0) * t.element_size() if c.dst else 0
                    ptrs[c.entry] = t.data_ptr() + offset
                    if t.device.type == "cuda":
                        devices[c.entry] = t.device.index
                    direct.add((i, j))
        buffers: dict[str, torch.Tensor] = {}
        for i, w in enumerate(self._wanted):
            for j, c in enumerate(w.copies):
                if (i, j) not in skip and c.entry not in ptrs and c.entry not in buffers:
                    e = self._entries[c.entry]
                    shape, dtype = tuple(e["shape"]), dtype_from_name(e["dtype"])
                    buffers[c.entry] = torch.empty(shape, dtype=dtype)
                    ptrs[c.entry] = buffers[c.entry].data_ptr()
        # In the manifest's order, which is the files' order: the engine reads runs of
        # consecutive extents in one request.
        order = {name: i for i, name in enumerate(self._entries)}
        targets = [
            {"name": n, "ptr": p, "nbytes": self._entries[n]["nbytes"],
             "device": devices.get(n, -1)}
            for n, p in sorted(ptrs.items(), key=lambda item: order[item[0]])
        ]
        if devices and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no kernel may still use a tensor the engine overwrites
        self._engine.read(self._manifest, targets)
        self.bytes_read = sum(t["nbytes"] for t in targets)
        with torch.no_grad():
            for i, w in enumerate(self._wanted):
                for j, c in enumerate(w.copies):
                    if (i, j) in direct or (i, j) in skip:
                        continue
                    # Each saved piece belongs to one tensor, so it is read once, here.
                    src = buffers[c.entry][tuple(slice(a, b) for a, b in c.src)]
                    w.out[tuple(slice(a, b) for a, b in c.dst)] = src

    def run_redistributed(
        self, group: Any, rank: int, world: int, failure: BaseException | None,
        ranks: Any = None, data_timeout: float | None = None,
    ) -> None:
        """Collective: the shards of saved rank s are read by rank s % world into one flat
        buffer, broadcast over `group`, and every rank copies what it needs from them.
        `ranks` carries the gathers and waits (a Checkpointer's Ranks: polled, so its abort()
        or a peer's mark ends them; default: blocking calls on `group`); `data_timeout` bounds
        the waits that follow reads and transfers (default: the gathers' own)."""
        ranks = ranks or Blocking(group, world)
        gathered = _gather_needs(ranks, rank, failure,
                                 sorted({c.entry for w in self._wanted for c in w.copies}),
                                 data_timeout)
        union = sorted(set().union(*gathered))
        where: dict[str, tuple[int, int]] = {}
        sizes = [0] * world
        for name in union:
            owner = self._entries[name]["rank"] % world
            where[name] = (owner, sizes[owner])
            sizes[owner] += (self._entries[name]["nbytes"] + 63) // 64 * 64
        flats = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        mine = [
            {"name": n, "ptr": flats[rank].data_ptr() + off, "nbytes": self._entries[n]["nbytes"]}
            for n, (owner, off) in where.items()
            if owner == rank
        ]
        error = None
        try:
            self._engine.read(self._manifest, mine)
            self.bytes_read = sum(m["nbytes"] for m in mine)
        except Exception as e:
            error = e
        mine_status = None if error is None else f"rank {rank}: {type(error).__name__}: {error}"
        status = ranks.gather(mine_status, data_timeout)
        if error is not None:
            raise error
        failed = [x for x in status if x is not None]
        if failed:
            raise CorruptCheckpointError(f"reading the checkpoint failed on {failed[0]}")
        for owner, flat in enumerate(flats):
            if flat.numel():
                ranks.wait(dist.broadcast(flat, src=owner, group=group, async_op=True),
                           data_timeout)
        buffers = {}
        for name, (owner, off) in where.items():
            e = self._entries[name]
            raw = flats[owner][off : off + e["nbytes"]]
            buffers[name] = raw.view(dtype_from_name(e["dtype"])).reshape(tuple(e["shape"]))
        with torch.no_grad():
            for w in self._wanted:
                for c in w.copies:
                    src = buffers[c.entry][tuple(slice(a, b) for a, b in c.src)]
                    w.out[tuple(slice(a, b) for a, b in c.dst)] = src

    def run_shared(self, group: Any, rank: int, world: int, failure: BaseException | None,
                   tag: str, ranks: Any = None, data_timeout: float | None = None) -> None:
        """Collective: every saved piece that several ranks of a host need is read from storage
        once per host, into one /dev/shm buffer (checkpoint.shm) that the host's ranks share:
        the pieces are split over them in contiguous runs of the files (each reads its run with
        the engine, which verifies the checksums), then each rank copies its own overlaps out.
        Across hosts (RESILIENT_HOST_ID or the hostname), the pieces every host needs are read
        once in all and each rank sends what it read to one rank of every other host (over
        NCCL in an NCCL job, else over `group`; checkpoint.exchange).
        A piece only one rank of the host needs is read by it straight into its target. A
        reading error on any rank raises on every rank; when a host's buffer cannot be created
        (/dev/shm full or missing) or a rank does not see it, every rank reads directly instead,
        with a warning. `tag` names this load (the same on every rank). `ranks` and
        `data_timeout`: as in run_redistributed (with a Checkpointer's Ranks, a peer that
        stops mid-load, frozen or gone, makes every rank raise CollectiveError within
        `data_timeout`, or at once on abort(), instead of waiting in gloo for the group's own
        timeout)."""
        handled = sys.exc_info()[1]  # a caller's error being handled: its frames are its own
        try:
            self._run_shared(group, rank, world, failure, tag, ranks, data_timeout)
        except BaseException as e:
            # The raised error's frames (and those of the errors it chains, raised in here)
            # held the host's buffer mapped (gigabytes) for as long as a caller keeps the
            # error, as a load that goes on to an older step does.
            seen = {id(handled)}
            chain: list[BaseException | None] = [e]
            while chain:
                err = chain.pop()
                if err is None or id(err) in seen:
                    continue
                seen.add(id(err))
                traceback.clear_frames(err.__traceback__)
                chain += [err.__cause__, err.__context__]
            raise

    def _run_shared(self, group: Any, rank: int, world: int, failure: BaseException | None,
                    tag: str, ranks: Any, data_timeout: float | None) -> None:
        ranks = ranks or Blocking(group, world)
        clock = time.perf_counter
        stamps = [("start", clock())]
        self.seconds = {}
        shm.wait_released()  # a last load's buffer, still being unmapped, holds /dev/shm pages
        needed = sorted({c.entry for w in self._wanted for c in w.copies})
        me_host = exchange.host_id()
        nccl = exchange.nccl_group()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl is not None else None
        report = {"host": me_host, "pid": os.getpid(), "needed": needed, "nccl": nccl is not None,
                  "gpu": device is not None and device_share.eligible(self._wanted, device),
                  "round_bytes": _round_bytes() if nccl is not None else 0}
        gathered = _gather_needs(ranks, rank, failure, report, data_timeout)
        round_bytes = gathered[0]["round_bytes"]  # rank 0's: the same GPU rounds on every rank
        if not all(g["nccl"] for g in gathered):  # NCCL only where every rank has it
            nccl = None
        counts = Counter(n for g in gathered for n in g["needed"])
        if (nccl is not None and all(g["gpu"] for g in gathered)
                and all(k in (1, world) for k in counts.values())):
            # every piece several ranks need is needed by all: read once, broadcast over NCCL
            self._run_device(group, rank, world, nccl, counts, round_bytes, ranks, data_timeout,
                             clock, stamps)
            return
        hosts = exchange.Hosts.of([g["host"] for g in gathered])
        local = hosts.ranks[me_host]
        order = {name: i for i, name in enumerate(self._entries)}

        def shared_by(ranks: list[int]) -> Counter:
            return Counter(n for r in ranks for n in gathered[r]["needed"])

        wanted_by = shared_by(local)
        # A piece needed on every host (with two hosts or more: replicated state, or the
        # replicas of a shard) is read from storage once in all, into every host's shared
        # buffer (resilient.checkpoint.exchange); another piece that several ranks of the host
        # need, once per host into the buffer; a piece only one rank of the host needs (a
        # shard) by that rank straight into its target.
        common_set: set[str] = set()
        if len(hosts.ranks) > 1:
            common_set = set.intersection(*(set(shared_by(rs)) for rs in hosts.ranks.values()))
        union = sorted((n for n, k in wanted_by.items() if k > 1 or n in common_set),
                       key=order.__getitem__)
        own = {n for n in needed if wanted_by[n] == 1 and n not in common_set}
        common = [n for n in union if n in common_set]  # the same list on every rank
        rest = [n for n in union if n not in common_set]
        where, size, share = host_share.layout(common, self._entries, world)  # readers: hosts.order
        where_rest, size_rest, share_rest = host_share.layout(rest, self._entries, len(local))
        plan = exchange.transfers(hosts, exchange.runs(hosts, common, where, share, size))
        where.update((n, size + off) for n, off in where_rest.items())
        size += size_rest
        # Each rank of the host reads its run, and the host's ranks copy each piece out as soon
        # as it is in place (checkpoint.host_share); the pieces other hosts read, after the
        # exchange.
        position = {r: hosts.order.index(r) for r in local}
        runs = [[n for n in common if share[n] == position[r] and self._entries[n]["nbytes"]]
                + [n for n in rest if share_rest[n] == i and self._entries[n]["nbytes"]]
                for i, r in enumerate(local)]  # (an empty piece needs no read, nor copy)
        index = {n: i for i, n in enumerate(n for run in runs for n in run)}  # its header word
        remote = [n for n in common if hosts.order[share[n]] not in local]
        receives = [(t.lo, t.hi) for t in plan if t.dst == rank]
        header = shm.header_bytes(len(local), len(index))
        path = os.path.join(shm.DIR, f"resilient-restore-{gathered[local[0]]['pid']}-{tag}")
        # The host's first rank creates the buffer with this load's tag in its header; every
        # other rank checks that it sees that file (ranks that report one hostname but do not
        # share /dev/shm, as containers may, would otherwise read from an empty copy).
        problem = None
        if rank == local[0] and size:
            try:
                shm.create(path, header + size, tag, header)
            except OSError as e:
                problem = f"{path}: {e}"
        # The creator unlinks the buffer on every way out (a peer that dies mid-load makes the
        # collectives raise, and a process that lives on must not keep the memory in /dev/shm).
        try:
            created = ranks.gather(problem, data_timeout)
            if any(p is not None for p in created):
                self._fall_back(path, rank == local[0], rank, created)
                return
            mapping = torch.empty(0, dtype=torch.uint8)
            populate, threads = False, self._engine.reader_threads(len(local))
            if size:
                try:
                    if rank != local[0]:
                        problem = shm.check(path, header + size, tag)
                    if problem is None:
                        mapping = shm.open_mapped(path, header + size)
                        populate = shm.can_populate(mapping)
                except OSError as e:
                    problem = f"{path}: {e}"
            # the host's ranks map one buffer, or none
            seen = ranks.gather((problem, populate, threads), data_timeout)
            if any(s[0] is not None for s in seen):
                self._fall_back(path, rank == local[0], rank, [s[0] for s in seen])
                return
            stamps.append(("plan", clock()))
            buffer = mapping[header:]
            progress = shm.Progress(mapping, len(local), len(index)) if size else None
            me = local.index(rank)

            cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None

            def then() -> int:  # on the reader's thread, whose current CUDA device is the 0th
                if cuda is not None:
                    torch.cuda.set_device(cuda)
                self.run(only=own)
                return self.bytes_read

            # The host's readers take the reads from one queue, so that they end together
            # however unevenly the storage serves them, where every one of them reserves the
            # pages as it writes them; else (before Linux 5.14) each reads its fixed run. The
            # queue's pieces are in the files' order, in which the engines take them (their
            # words follow it, for the copiers' window), and the readers plan with one thread
            # count (their plans must match).
            queued = len(local) > 1 and all(seen[r][1] for r in local) and progress is not None
            lanes = runs
            if queued:
                lanes = [sorted((n for run in runs for n in run),
                                key=lambda n: (self._entries[n]["shard"], order[n]))]
                index = {n: i for i, n in enumerate(lanes[0])}
            agreed = min(seen[r][2] for r in local) if queued else 0
            reading = host_share.RunReader(
                lambda targets, queue: self._engine.read(self._manifest, targets,
                                                         local_ranks=len(local), queue=queue,
                                                         threads=agreed),
                then, path, mapping, header, where, self._entries,
                lanes[0] if queued else runs[me], receives, index, me, progress,
                populate=populate, queue=progress.queue if queued else 0)
            error: BaseException | None = None
            copying: dict[str, float] = {}
            started = False
            try:
                reading.start()
                started = True
                copying = self._copy_arrivals(buffer, where, lanes, set(needed), index,
                                              progress, ranks, data_timeout, len(local),
                                              window=256 * len(local) if queued else 256)
            except CollectiveError:
                reading.stop()
                raise  # a peer stopped, or abort(): every rank raises it, without the gather
            except Exception as e:
                error = e
                if progress is not None and not started:  # its reader never ran
                    progress.publish(me, shm.Progress.FAILED)
            finally:
                if reading.is_alive():
                    reading.join()  # its reads are local, bounded by the disk
            error = reading.error or error
            self.bytes_read = reading.bytes_read
            stamps.append(("read", clock()))
            detail = {f"read.{k}": v for k, v in {**reading.seconds, **copying}.items()}
            mine = None if error is None else f"rank {rank}: {type(error).__name__}: {error}"
            if reading.no_room:
                mine = ("not shared", mine)
            status = ranks.gather(mine, data_timeout)
            stamps.append(("wait_reads", clock()))
        finally:
            if rank == local[0]:
                shm.unlink(path)  # every rank of the host has it mapped (or failed)
        if any(isinstance(x, tuple) for x in status):
            del buffer, mapping, progress, reading, error  # the pages go back before the reads
            self._fall_back(path, False, rank, [x[1] for x in status if isinstance(x, tuple)])
            return
        if error is not None:
            raise error
        failed = [x for x in status if x is not None]
        if failed:
            raise CorruptCheckpointError(f"reading the checkpoint failed on {failed[0]}")
        if progress is not None and 0 in progress.pieces_done(0, len(index)):
            # every read of the host ended without error, so every piece must be in place:
            # never send or return a buffer that is not (the same on every rank of the host)
            raise RuntimeError("restore: the host's reads ended without error but pieces of "
                               "its shared buffer are not in place (a bug in resilient)")
        if plan:
            report = exchange.send_and_receive(buffer, plan, rank, group, nccl,
                                               lambda w: ranks.wait(w, data_timeout),
                                               lambda o: ranks.gather(o, data_timeout))
            stamps.append(("exchange", clock()))
            everyone = ranks.gather(report, data_timeout)  # also: received, host-wide
            stamps.append(("wait_exchange", clock()))
            bad = exchange.mismatches(everyone, plan)
            if bad:  # not what its host read: every rank reads directly instead
                self._fall_back(path, False, rank, [f"the copy between hosts differs: {bad}"])
                return
        with torch.no_grad():
            for n in remote:
                self._copy_out(n, buffer[where[n]: where[n] + self._entries[n]["nbytes"]], None)
        stamps.append(("copy", clock()))
        # Unmapping the buffer takes a rank about 0.2 s per GiB (its page tables; the last rank
        # to unmap also frees the pages): done on a thread, after every copy, beside whatever
        # the job does next (benchmarks/RESULTS.md).
        held = [mapping]
        del buffer, mapping, progress, reading
        shm.release_later(held)
        self.seconds = {name: round(t - stamps[i][1], 4)
                        for i, (name, t) in enumerate(stamps[1:])}
        self.seconds.update(detail)

    def _run_device(self, group: Any, rank: int, world: int, nccl: Any, counts: Counter,
                    round_bytes: int, ranks: Any, data_timeout: float | None, clock: Any,
                    stamps: list) -> None:
        """run_shared in an NCCL job (checkpoint.device_share): the pieces every rank needs are
        split over the ranks in contiguous runs of the files, each read once into GPU memory
        (the reader's own target where the piece fills whole rows of it) and broadcast; the
        others each rank reads straight into its target."""
        device = torch.device("cuda", torch.cuda.current_device())
        order = {name: i for i, name in enumerate(self._entries)}
        shared = sorted((n for n, k in counts.items() if k > 1), key=order.__getitem__)
        _, _, share = host_share.layout(shared, self._entries, world)
        mine = {c.entry for w in self._wanted for c in w.copies}
        own = mine - set(shared)
        # Where each shared piece lands on this rank: a target's rows it fills whole, or a
        # temporary (allocated before the reads, so that running out of GPU memory is reported
        # to every rank, not met by one of them in the middle of the broadcasts).
        lands: dict[str, tuple[torch.Tensor, tuple[int, int]]] = {}
        for i, w in enumerate(self._wanted):
            t = w.out
            if t.device != device or not t.is_contiguous() or t.is_conj():
                continue
            for j, c in enumerate(w.copies):
                if c.entry in counts and counts[c.entry] > 1 and c.entry not in lands \
                        and self._lands_whole(c, t):
                    offset = c.dst[0][0] * t.stride(0) * t.element_size() if c.dst else 0
                    lands[c.entry] = (device_share.byte_view(t, offset,
                                                             self._entries[c.entry]["nbytes"]),
                                      (i, j))

        error: BaseException | None = None
        held: dict[str, torch.Tensor] = {}
        try:
            held = {n: lands[n][0] if n in lands else torch.empty(
                self._entries[n]["nbytes"], dtype=torch.uint8, device=device) for n in shared}
            self.run(only=own)
        except Exception as e:
            error = e
        stamps.append(("read_own", clock()))
        status = ranks.gather(None if error is None else
                              f"rank {rank}: {type(error).__name__}: {error}", data_timeout)
        stamps.append(("wait_reads", clock()))
        if error is not None:
            raise error
        failed = [x for x in status if x is not None]
        if failed:
            raise CorruptCheckpointError(f"reading the checkpoint failed on {failed[0]}")
        # The broadcasts overlap the reads: in each round every reader reads its next part of
        # its run, then every rank issues that round's broadcasts (NCCL runs them while the
        # next round is read). Every rank joins every broadcast, even after an error of its
        # own (a read that failed, out of GPU memory in a sum or a copy), and reports the
        # error in the gather below: no rank is left waiting in NCCL for one that stopped.
        # Before a round is read, the one before the last has ended (a polled wait: a peer
        # that stops ends the load within data_timeout, or at once on abort). Copies into CPU
        # targets (which would block this thread on the broadcasts) wait for the end.
        torch.cuda.synchronize()  # no kernel may still use a tensor the engine overwrites
        rounds = device_share.rounds(shared, share, self._entries, world, round_bytes)
        digests, works, late, bad_read = [], [], None, None
        issued: list[int] = []  # len(works) after each round
        waited = 0  # works[:waited] have ended
        to_cpu: list[tuple[str, torch.Tensor, tuple[int, int] | None]] = []
        with torch.no_grad():
            for batch in rounds:
                if len(issued) >= 2:
                    for work in works[waited:issued[-2]]:
                        ranks.wait(work, data_timeout)
                    waited = max(waited, issued[-2])
                reads = [n for n in batch if share[n] == rank]
                if reads and bad_read is None:
                    try:
                        self._engine.read(self._manifest, [
                            {"name": n, "ptr": held[n].data_ptr(), "nbytes": held[n].numel(),
                             "device": device.index} for n in reads])
                        self.bytes_read += sum(held[n].numel() for n in reads)
                    except Exception as e:
                        bad_read = e
                for n in batch:
                    buf = held.pop(n)
                    work = dist.broadcast(buf, src=dist.get_global_rank(group, share[n]),
                                          group=nccl, async_op=True)
                    works.append(work)
                    try:
                        if late is None:
                            work.wait()  # the stream's order: the sum and copies follow it
                            digests.append(device_share.digest(buf))
                            done = lands[n][1] if n in lands else None
                            if self._copy_out(n, buf, done, cpu=False):
                                to_cpu.append((n, buf, done))
                    except Exception as e:
                        late = e
                issued.append(len(works))
        stamps.append(("read", clock()))
        for work in works[waited:]:
            ranks.wait(work, data_timeout)  # polled: an abort or the timeout ends it
        try:
            for n, buf, done in to_cpu:
                if late is None:
                    self._copy_out(n, buf, done, cpu=True)
        except Exception as e:
            late = e
        stamps.append(("broadcast", clock()))
        try:
            sums: Any = torch.stack(digests).tolist() if digests and late is None else []
        except Exception as e:
            late = e
        if bad_read is not None:
            sums = ("read", f"rank {rank}: {type(bad_read).__name__}: {bad_read}")
        elif late is not None:
            sums = f"rank {rank}: {type(late).__name__}: {late}"
        everyone = ranks.gather(sums, data_timeout)
        stamps.append(("wait_broadcast", clock()))
        if bad_read is not None:
            raise bad_read
        failed = [x[1] for x in everyone if isinstance(x, tuple)]
        if failed:
            raise CorruptCheckpointError(f"reading the checkpoint failed on {failed[0]}")
        errors = [x for x in everyone if isinstance(x, str)]
        if errors:
            raise ResilientError(f"loading failed after the reads: {errors[0]}")
        # Every rank's sums equal the reader's for every piece, or every rank reads directly.
        sent = [n for batch in rounds for n in batch]  # the digests' order on every rank
        bad = [f"{n} at rank {r}" for r, theirs in enumerate(everyone)
               for i, n in enumerate(sent) if theirs[i] != everyone[share[n]][i]]
        if bad:
            if rank == 0:
                log.warning("restore: %d piece(s) broadcast over NCCL differ from what was read "
                            "(%s); every rank reads directly", len(bad), bad[0])
            self.run()
            return
        self.seconds = {name: round(t - stamps[i][1], 4)
                        for i, (name, t) in enumerate(stamps[1:])}

    def _copy_arrivals(self, buffer: torch.Tensor, where: dict[str, int], runs: list[list[str]],
                       wanted: set[str], index: dict[str, int], progress: shm.Progress | None,
                       ranks: Any, timeout: float | None, local: int,
                       window: int = 256) -> dict[str, float]:
        """Copies the pieces this rank needs (`wanted`) out of the host's buffer, each once it
        is in place (runs[i]: the pieces of a run of reads, in order; host_share.Arrivals), on
        a few threads (host_share.copy_workers; `local`: the host's ranks) where every target
        is in host memory, else on this thread (the caller's CUDA streams). Stops at a reader's
        failure, which the gather after the reads reports. Returns its seconds waiting for
        pieces ("waits") and from the last arrival to the end of the copies ("tail")."""
        if progress is None:  # no buffer: nothing shared
            return {}
        arrivals = host_share.Arrivals(progress, runs, index, wanted, timeout or 600.0,
                                       window=window, readers=local)
        self._copies_map()  # built here, not by the copy threads at once
        inference = torch.is_inference_mode_enabled()

        def copy(n: str, view: torch.Tensor) -> None:
            # grad and inference modes are per thread: the caller's inference mode, on any
            with torch.no_grad(), torch.inference_mode(inference):
                self._copy_out(n, view, None)

        clock = time.perf_counter
        waits = 0.0
        workers = host_share.copy_workers(local)
        if any(w.out.device.type != "cpu" for w in self._wanted):
            workers = 0  # device targets: copied on this thread, on the caller's streams
        pool = ThreadPoolExecutor(max(1, workers), "resilient-restore-copy")
        futures = []
        try:
            while arrivals.left():
                t0 = clock()
                ranks.wait(arrivals, timeout)
                waits += clock() - t0
                if arrivals.failed:
                    break
                for n in arrivals.take():
                    view = buffer[where[n]: where[n] + self._entries[n]["nbytes"]]
                    if workers:
                        futures.append(pool.submit(copy, n, view))
                    else:
                        copy(n, view)
            last = clock()
            for f in futures:
                f.result()  # the first copy that failed raises here
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # no copy runs on after a raise
        return {"waits": round(waits, 4), "tail": round(clock() - last, 4)}

    def _copies_map(self) -> dict[str, list[tuple[int, int]]]:
        """Saved piece -> its copies (wanted, copy), built once (not a scan per piece)."""
        if self._copies_of is None:
            self._copies_of = {}
            for i, w in enumerate(self._wanted):
                for j, c in enumerate(w.copies):
                    self._copies_of.setdefault(c.entry, []).append((i, j))
        return self._copies_of

    def _copy_out(self, entry: str, raw: torch.Tensor, done: tuple[int, int] | None,
                  cpu: bool | None = None) -> bool:
        """The copies of saved piece `entry` (its bytes in `raw`) into this rank's targets,
        but the one it landed in (`done`: (wanted, copy)); only those into CPU targets
        (`cpu` True) or only the others (False). Returns whether copies were left out."""
        e = self._entries[entry]
        src = raw.view(dtype_from_name(e["dtype"])).reshape(tuple(e["shape"]))
        left = False
        for i, j in self._copies_map().get(entry, ()):
            if (i, j) != done:
                w, c = self._wanted[i], self._wanted[i].copies[j]
                if cpu is not None and (w.out.device.type == "cpu") != cpu:
                    left = True
                    continue
                w.out[tuple(slice(a, b) for a, b in c.dst)] = src[
                    tuple(slice(a, b) for a, b in c.src)]
        return left

    def _fall_back(self, path: str, creator: bool, rank: int, why: list) -> None:
        """run_shared without a usable buffer: every rank reads directly (the same on all)."""
        if creator:
            shm.unlink(path)
        if rank == 0:
            log.warning("restore: no shared read buffer (%s); every rank reads directly",
                        next(w for w in why if w is not None))
        self.run()

    def _lands_whole(self, c: Any, t: torch.Tensor) -> bool:
        """True when copy `c` moves a whole saved piece onto whole rows of `t` (contiguous)."""
        e = self._entries[c.entry]
        if e["dtype"] != dtype_name(t.dtype):
            return False
        whole_src = all(a == 0 and b == n for (a, b), n in zip(c.src, e["shape"]))
        full_rows = all(a == 0 and b == n for (a, b), n in zip(c.dst[1:], t.shape[1:]))
        return whole_src and full_rows


def _round_bytes() -> int:
    """RESILIENT_RESTORE_ROUND_BYTES; a tuning knob, so a malformed value warns and gives its
    default (from settings.toml) instead of failing the load."""
    try:
        return settings.get("RESILIENT_RESTORE_ROUND_BYTES")
    except ValueError as e:
        knob = settings.lookup("RESILIENT_RESTORE_ROUND_BYTES")
        value = knob.parse(knob.default)
        log.warning("restore: %s; rounds of %d bytes", e, value)
        return value


def _gather_needs(ranks: Any, rank: int, failure: BaseException | None,
                  report: Any, timeout: float | None = None) -> list[Any]:
    """Collective: every rank's `report` (what it needs), or raises on every rank when one
    rank's planning failed (`failure`): CorruptCheckpointError when that is skippable (an older
    step may load), ValueError otherwise; so no rank waits in a later collective."""
    skippable = (CorruptCheckpointError, VersionMismatchError, FileNotFoundError, OSError)
    if failure is not None:
        report = (isinstance(failure, skippable), f"rank {rank}: {failure}")
    gathered = ranks.gather(report, timeout)
    if failure is not None:
        raise failure
    bad = [g for g in gathered if isinstance(g, tuple)]
    if bad:
        error_type = CorruptCheckpointError if bad[0][0] else ValueError
        raise error_type(f"loading failed on another rank: {bad[0][1]}")
    return gathered
