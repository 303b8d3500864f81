"""Between hosts, in a shared restore (Reader.run_shared): the saved pieces that every host reads
into its /dev/shm buffer (replicated state) are read from storage once in all, not once per host.

They come first in every host's buffer, at the same offsets, and are split over all the job's
ranks, host after host, in contiguous runs of the files: each rank reads one run. Every rank then
sends the run it read to one rank of each other host (the rank with the same position on its
host, wrapping around a smaller host), which writes it into its own host's buffer at the same
offset. So every rank's link carries a share of the traffic, as every GPU's NIC does in a
cluster, not only one rank's per host. The transport is NCCL, staged through the rank's GPU in
chunks, when the job's default process group is NCCL (the fastest path between GPU hosts), and
the process group of the load (gloo) otherwise. Each receiver checks the XXH3 of every run it
received against the sender's (the senders verified the chunk checksums when reading from
storage); any mismatch or transfer error makes every rank read directly instead. A peer that
stops mid-exchange (frozen, or its host gone) ends the exchange with CollectiveError on every
rank, within the wait's timeout or at once on an abort (the `wait` the reader passes)."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from resilient import _C, settings
from resilient.errors import CollectiveError

#: Bytes per NCCL transfer: the GPU staging holds one chunk to send and one per run received,
#: NCCL_STAGING at most (smaller chunks where a rank receives many runs).
NCCL_CHUNK = 256 << 20
NCCL_STAGING = 1 << 30


def host_id() -> str:
    """This rank's host for the shared restore: RESILIENT_HOST_ID, else the hostname."""
    return settings.get("host_id") or socket.gethostname()


@dataclass
class Hosts:
    """The job's hosts (in the order of their first rank) and their ranks."""

    ranks: dict[str, list[int]]
    order: list[int] = field(init=False)  # every rank, host after host

    def __post_init__(self) -> None:
        self.order = [r for rs in self.ranks.values() for r in rs]

    @classmethod
    def of(cls, host_of_rank: list[str]) -> Hosts:
        ranks: dict[str, list[int]] = {}
        for r, h in enumerate(host_of_rank):
            ranks.setdefault(h, []).append(r)
        return cls(ranks)

    def host_of(self, rank: int) -> str:
        return next(h for h, rs in self.ranks.items() if rank in rs)


@dataclass(frozen=True)
class Transfer:
    """Bytes [lo, hi) of the buffer, read from storage by `src`, sent to `dst` (another host)."""

    src: int
    dst: int
    lo: int
    hi: int


def runs(hosts: Hosts, common: list[str], where: dict[str, int], share: dict[str, int],
         end: int) -> dict[int, tuple[int, int]]:
    """Per rank, the byte range of the buffer it reads: the pieces of `common` whose reader
    (`share`: an index into hosts.order) it is, from the first one's offset (`where`) to the next
    piece's, or `end` (where the common pieces end). Contiguous, because the shares follow the
    files' order. Ranks that read nothing are left out."""
    out: dict[int, tuple[int, int]] = {}
    for i, name in enumerate(common):
        rank = hosts.order[share[name]]
        hi = where[common[i + 1]] if i + 1 < len(common) else end
        lo = out[rank][0] if rank in out else where[name]
        out[rank] = (lo, hi)
    return out


def transfers(hosts: Hosts, read: dict[int, tuple[int, int]]) -> list[Transfer]:
    """Every run goes to one rank of each other host: the rank at the sender's position on its
    own host, modulo the receiving host's size (so a host's receives are spread over its ranks).
    The same list on every rank."""
    out = []
    for src, (lo, hi) in sorted(read.items()):
        if hi <= lo:
            continue
        mine = hosts.host_of(src)
        pos = hosts.ranks[mine].index(src)
        for h, rs in hosts.ranks.items():
            if h != mine:
                out.append(Transfer(src, rs[pos % len(rs)], lo, hi))
    return out


def nccl_group() -> Any:
    """The default process group when it is NCCL (and a GPU is there): the exchange's transport;
    else None (the load's gloo group carries it)."""
    if not (dist.is_available() and dist.is_initialized() and torch.cuda.is_available()):
        return None
    return dist.group.WORLD if "nccl" in str(dist.get_backend()) else None


def send_and_receive(buffer: torch.Tensor, plan: list[Transfer], rank: int,
                     group: Any, nccl: Any, wait: Callable[[Any], None],
                     gather: Callable[[Any], list[Any]]) -> dict[str, Any]:
    """Collective over `group` (every rank calls it with the same plan and the same `nccl`):
    sends this rank's run and receives the runs sent to it into `buffer`, over `nccl` (the
    default group, when every rank has NCCL) or else over `group`; `wait(work)` waits for a
    transfer and `gather(obj)` is an all-gather of small objects over `group` (the
    Checkpointer's: both polled). Returns what the check needs: {"sent": XXH3 of the run this
    rank read, or None, "got": {src: XXH3 of what arrived}, "error": a transfer's error or
    None}. Never raises for a transfer that failed (every rank must reach the gather of these
    reports), but raises the CollectiveError of a wait (a Checkpointer's: timed out, aborted,
    or a peer gone): the group is broken then, and the others learn it from the job's store
    or their own waits, not from a gather that would wait for the lost peer."""
    mine = [t for t in plan if rank in (t.src, t.dst)]
    report: dict[str, Any] = {"sent": None, "got": {}, "error": None}
    try:
        staging = None
        chunk = chunk_bytes(plan)
        if nccl is not None and plan:
            # The GPU staging is allocated before any transfer, and every rank learns whether
            # each one got it: a rank that fails there must not leave its partners waiting.
            problem = None
            try:
                staging = _staging(mine, rank, chunk)
            except Exception as e:  # noqa: BLE001 -- e.g. out of GPU memory
                problem = f"rank {rank}: {type(e).__name__}: {e}"
            ready = gather(problem)
            if any(ready):
                report["error"] = next(p for p in ready if p)
                return report
        if mine:
            if staging is not None:
                _over_nccl(buffer, mine, rank, group, nccl, staging, chunk, wait)
            else:
                wait(_OnThread(lambda: _over_group(buffer, mine, rank, group)))
        for t in mine:
            if t.src == rank and report["sent"] is None:
                report["sent"] = _C.xxh3_buffer(buffer.data_ptr() + t.lo, t.hi - t.lo)
            elif t.dst == rank:
                report["got"][t.src] = _C.xxh3_buffer(buffer.data_ptr() + t.lo, t.hi - t.lo)
    except CollectiveError:  # the wait timed out or was aborted, or a peer is gone: the
        raise  # checkpointer's group is broken, and a gather of reports could wait for the peer
    except Exception as e:  # noqa: BLE001 -- reported to every rank, which then reads directly
        report["error"] = f"rank {rank}: {type(e).__name__}: {e}"
    return report


def mismatches(reports: list[Any], plan: list[Transfer]) -> list[str]:
    """What went wrong in the exchange, from every rank's send_and_receive report (None from a
    rank that took no part): transfer errors, and runs that arrived with another XXH3 than the
    sender's."""
    bad = [r["error"] for r in reports if r and r["error"]]
    for t in plan:
        sent = (reports[t.src] or {}).get("sent")
        got = (reports[t.dst] or {}).get("got", {}).get(t.src)
        if sent is None or got != sent:
            bad.append(f"bytes {t.lo}..{t.hi} from rank {t.src} at rank {t.dst}")
    return bad


def chunk_bytes(plan: list[Transfer]) -> int:
    """The NCCL exchange's transfer size, the same on every rank: NCCL_CHUNK, or less where a
    rank receives so many runs that its staging (one chunk per run received, and one to send)
    would pass NCCL_STAGING (at least 1 MiB)."""
    receives: dict[int, int] = {}
    for t in plan:
        receives[t.dst] = receives.get(t.dst, 0) + 1
    most = max(receives.values(), default=0)
    return max(1 << 20, min(NCCL_CHUNK, NCCL_STAGING // (most + 1)) >> 20 << 20)


class _OnThread:
    """`fn` on a thread of its own, as a work that can be polled (is_completed, then wait):
    gloo's point-to-point works complete only inside their wait(), which a frozen peer holds
    for the group's whole timeout. A wait given up on leaves the thread to that timeout."""

    def __init__(self, fn: Callable[[], None]):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                        name="resilient-exchange")
        self._thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- raised again by wait()
            self._error = e

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _over_group(buffer: torch.Tensor, mine: list[Transfer], rank: int, group: Any) -> None:
    """Over gloo (send_and_receive runs it on a thread: see _OnThread); a lost peer closes its
    connections, which ends the wait with an error."""
    works = []
    for t in mine:
        if t.src == rank:
            works.append(dist.isend(buffer[t.lo:t.hi], group=group, group_dst=t.dst))
        else:
            works.append(dist.irecv(buffer[t.lo:t.hi], group=group, group_src=t.src))
    for w in works:
        w.wait()


def _staging(mine: list[Transfer], rank: int, chunk: int) -> dict[Any, torch.Tensor]:
    """GPU memory for the NCCL exchange: one chunk for the run this rank sends ("send"), one per
    run it receives (keyed by the transfer)."""
    device = torch.device("cuda", torch.cuda.current_device())
    out: dict[Any, torch.Tensor] = {}
    for t in mine:
        key = "send" if t.src == rank else t
        if key not in out:
            out[key] = torch.empty(min(chunk, t.hi - t.lo), dtype=torch.uint8,
                                   device=device)
    return out


def _over_nccl(buffer: torch.Tensor, mine: list[Transfer], rank: int, group: Any, nccl: Any,
               staging: dict[Any, torch.Tensor], chunk: int,
               wait: Callable[[Any], None]) -> None:
    """NCCL point-to-point, staged through this rank's GPU chunk by chunk. Ranks meet their
    partners in one global order of rank pairs, the lower rank of a pair sending first: NCCL
    creates each pair's communicator on first use, blocking both sides, and a pair's transfers
    run in order on its stream, so any other order could wait in a cycle."""
    def glob(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    def pair(t: Transfer) -> tuple[int, int, int]:
        # a pair exchanges at most one run each way: the lower rank's run first
        return (min(t.src, t.dst), max(t.src, t.dst), 0 if t.src < t.dst else 1)

    mine = sorted(mine, key=pair)
    rounds = max(-(-(t.hi - t.lo) // chunk) for t in mine)
    on_gpu = next(iter(staging.values())).is_cuda  # (CPU staging: the tests' in-process fake)
    sync = torch.cuda.current_stream().synchronize if on_gpu else (lambda: None)
    for k in range(rounds):
        works, landing, staged = [], [], False
        for t in mine:
            lo = t.lo + k * chunk
            hi = min(t.hi, lo + chunk)
            if lo >= hi:
                continue
            if t.src == rank:
                part = staging["send"][:hi - lo]
                if not staged:  # this rank sends one run, to each other host
                    part.copy_(buffer[lo:hi])
                    staged = True
                works.append(dist.isend(part, dst=glob(t.dst), group=nccl))
            else:
                part = staging[t][:hi - lo]
                works.append(dist.irecv(part, src=glob(t.src), group=nccl))
                landing.append((lo, hi, part))
        for w in works:
            wait(w)  # polled (an abort or the collective timeout ends it), then w.wait(): the
            # current stream waits for the transfer, so the copies below follow it
        for lo, hi, part in landing:
            buffer[lo:hi].copy_(part)  # into pageable host memory: synchronous
        sync()  # the sends are done: the staging is free for the next round
