"""checkpoint.exchange's NCCL transfers (rounds of chunks through a staging buffer, partners met
in one global order) run here on CPU: each rank is a thread, and dist.isend/irecv are replaced
by an in-process mailbox, so the chunking, the rounds and the copies back into the host buffer
are checked for any plan without GPUs (the GPU test runs the same code over NCCL)."""

from __future__ import annotations

import queue
import threading

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.checkpoint import exchange
from resilient.checkpoint.host_share import layout as _layout


class _Mailbox:
    def __init__(self):
        self.boxes: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()
        self.local = threading.local()

    def box(self, src: int, dst: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((src, dst), queue.Queue())

    def isend(self, tensor, dst, group=None):
        self.box(self.local.rank, dst).put(tensor.clone())
        return _Done()

    def irecv(self, tensor, src, group=None):
        box = self.box(src, self.local.rank)

        class Recv:
            def wait(self):
                tensor.copy_(box.get(timeout=10))

            def is_completed(self):
                return True

        return Recv()


class _Done:
    def wait(self):
        pass

    def is_completed(self):
        return True


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # patched once, same fakes
@given(sizes=st.lists(st.integers(1, 300_000), min_size=1, max_size=12),
       host_sizes=st.lists(st.integers(1, 3), min_size=2, max_size=4),
       chunk=st.sampled_from([4096, 65536, 1 << 20]))
def test_rounds_deliver_every_run_into_every_other_hosts_buffer(sizes, host_sizes, chunk,
                                                                 monkeypatch):
    names = [f"h{h}" for h, n in enumerate(host_sizes) for _ in range(n)]
    hosts = exchange.Hosts.of(names)
    world = len(names)
    entries = {f"e{i}": {"nbytes": n} for i, n in enumerate(sizes)}
    where, size, share = _layout(list(entries), entries, world)
    runs = exchange.runs(hosts, list(entries), where, share, size)
    plan = exchange.transfers(hosts, runs)
    truth = torch.randint(0, 256, (size,), dtype=torch.uint8)
    buffers = {}  # each rank's host buffer: only the run it read is filled
    for r in range(world):
        buffers[r] = torch.zeros(size, dtype=torch.uint8)
        if r in runs:
            lo, hi = runs[r]
            buffers[r][lo:hi] = truth[lo:hi]
    mail = _Mailbox()
    monkeypatch.setattr(exchange.dist, "isend", mail.isend)
    monkeypatch.setattr(exchange.dist, "irecv", mail.irecv)
    errors = []

    def rank_main(r: int) -> None:
        mail.local.rank = r
        try:
            mine = [t for t in plan if r in (t.src, t.dst)]
            if mine:
                staging = {("send" if t.src == r else t): torch.empty(
                    min(chunk, t.hi - t.lo), dtype=torch.uint8) for t in mine}
                exchange._over_nccl(buffers[r], mine, r, None, None, staging, chunk,
                                    lambda w: w.wait())
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append((r, e))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for h, ranks in hosts.ranks.items():  # the host's buffer: its ranks' parts together
        host = torch.zeros(size, dtype=torch.uint8)
        for r in ranks:
            got = [t for t in plan if t.dst == r] + (
                [exchange.Transfer(r, r, *runs[r])] if r in runs else [])
            for t in got:
                host[t.lo:t.hi] = buffers[r][t.lo:t.hi]
        assert torch.equal(host, truth), h
