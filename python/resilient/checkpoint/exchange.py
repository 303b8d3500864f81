"""Between hosts, in a shared restore (Reader.run_shared): the saved pieces that every host reads
into its /dev/shm buffer (replicated state) are read from storage once in all, not once per host.
They come first in every host's buffer, at the same offsets; they are split over all the job's
ranks, host after host, in contiguous runs of the files, so each host's ranks read one stretch of
the buffer; then each host's first rank sends its host's stretch to the other hosts' first ranks
over the process group, and every first rank checks the XXH3 of each stretch it received against
the sender's (the readers verified the chunk checksums when reading from storage)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resilient import _C, settings


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

    def leaders(self) -> list[int]:
        return [rs[0] for rs in self.ranks.values()]


def stretches(hosts: Hosts, common: list[str], where: dict[str, int], share: dict[str, int],
              end: int) -> dict[str, tuple[int, int]]:
    """Per host, the byte range of the buffer that its ranks read: the pieces of `common` whose
    reader (`share`: an index into hosts.order) is one of its ranks, from the first one's offset
    (`where`) to the next piece's, or `end` (where the common pieces end). Contiguous, because
    the shares follow the files' order and hosts.order lists each host's ranks together."""
    out = {}
    start, i = 0, 0
    for h, rs in hosts.ranks.items():
        start += len(rs)
        first = i
        while i < len(common) and share[common[i]] < start:
            i += 1
        if i == first:
            out[h] = (0, 0)
        else:
            out[h] = (where[common[first]], where[common[i]] if i < len(common) else end)
    return out


def send_and_receive(buffer: torch.Tensor, hosts: Hosts, ranges: dict[str, tuple[int, int]],
                     me: str, group: Any) -> dict[str, int]:
    """Run by each host's first rank once its host's ranks have read their stretches: sends its
    host's stretch to every other first rank and receives theirs into `buffer`. Returns the XXH3
    of every non-empty stretch as it is in this buffer afterwards."""
    works = []
    for h, rs in hosts.ranks.items():
        lo, hi = ranges[h]
        if hi <= lo or len(hosts.ranks) < 2:
            continue
        if h == me:
            for other in hosts.leaders():
                if other != rs[0]:
                    works.append(dist.isend(buffer[lo:hi], group=group, group_dst=other))
        else:
            works.append(dist.irecv(buffer[lo:hi], group=group, group_src=rs[0]))
    for w in works:
        w.wait()
    return {h: _C.xxh3_buffer(buffer.data_ptr() + lo, hi - lo)
            for h, (lo, hi) in ranges.items() if hi > lo}


def mismatches(digests: list[Any], hosts: Hosts) -> list[str]:
    """The stretches (host names) that some first rank holds with another XXH3 than the host
    that read them; `digests`: every rank's send_and_receive result (None off the first ranks)."""
    bad = []
    for h, rs in hosts.ranks.items():
        sent = (digests[rs[0]] or {}).get(h)
        for leader in hosts.leaders():
            got = (digests[leader] or {}).get(h)
            if got != sent:
                bad.append(f"{h} (at rank {leader})")
    return bad
