"""The rebuild gate (resilient.recovery.gate): one outcome per generation, followed by all."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")

from resilient.recovery.gate import GateAbandoned, meet  # noqa: E402


def _store() -> dist.Store:
    return dist.HashStore()


def _run(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_every_member_arrives_and_all_go() -> None:
    store, out = _store(), {}

    def member(m: int) -> None:
        meet(store, "gen1000", m, [0, 1, 2], newer=lambda: False, timeout_s=30)
        out[m] = "go"

    threads = [_run(lambda m=m: member(m)) for m in (0, 1, 2)]
    for t in threads:
        t.join(30)
    assert out == {0: "go", 1: "go", 2: "go"}


def test_a_newer_generation_abandons_the_gate_for_late_members_too() -> None:
    """Member 0 waits, sees the newer generation and abandons; member 1 arrives afterwards (so
    every member has arrived) and still leaves: it follows the gate's one outcome."""
    store = _store()
    with pytest.raises(GateAbandoned, match="newer generation"):
        meet(store, "gen1000", 0, [0, 1], newer=lambda: True, timeout_s=30)
    with pytest.raises(GateAbandoned):
        meet(store, "gen1000", 1, [0, 1], newer=lambda: False, timeout_s=30)
    # the next generation's gate is a new one
    done = _run(lambda: meet(store, "gen2000", 0, [0, 1], newer=lambda: False, timeout_s=30))
    meet(store, "gen2000", 1, [0, 1], newer=lambda: False, timeout_s=30)
    done.join(30)
    assert not done.is_alive()


def test_a_gate_every_member_reached_opens_even_when_a_newer_generation_exists() -> None:
    store = _store()
    store.set("gen1000/resilient-gate/in/1", b"1")  # member 1 is already in
    meet(store, "gen1000", 0, [0, 1], newer=lambda: True, timeout_s=30)
    assert store.get("gen1000/resilient-gate/outcome") == b"go"


def test_a_member_that_never_arrives_times_the_gate_out_with_its_name() -> None:
    store, now = _store(), [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(GateAbandoned, match=r"members \[2\] did not arrive within 5"):
        meet(store, "gen3000", 0, [0, 2], newer=lambda: False, timeout_s=5,
             clock=lambda: now[0], sleep=sleep, poll_s=0.5)
    assert 5 <= now[0] <= 6


def test_the_gate_works_over_tcpstore() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=30))
    t = _run(lambda: meet(server, "gen1000", 0, [0, 1], newer=lambda: False, timeout_s=30))
    meet(client, "gen1000", 1, [0, 1], newer=lambda: False, timeout_s=30)
    t.join(30)
    assert not t.is_alive()


def test_only_a_tcpstore_may_be_served_by_a_rank() -> None:
    """The "served by rank 0" warning is for TCPStores (prefixed or not), never for etcd."""
    from resilient.recovery.environment import may_be_served_by_a_rank

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert may_be_served_by_a_rank(server)
    assert may_be_served_by_a_rank(dist.PrefixStore("a", dist.PrefixStore("b", server)))
    assert not may_be_served_by_a_rank(dist.HashStore())
    from resilient.etcd import EtcdStore

    etcd = EtcdStore(["127.0.0.1:1"])  # not contacted: where it lives is all that counts
    assert not may_be_served_by_a_rank(dist.PrefixStore("job", etcd))
