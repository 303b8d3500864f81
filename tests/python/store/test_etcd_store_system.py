"""resilient.etcd.EtcdStore against real etcd servers (Debian's etcd-server, started here): the
Store contract through the native adapter, atomic add and first-writer-wins compare_set from many
threads, a gloo process group rendezvousing through it, a dead or frozen server as a bounded
ConnectionError / TimeoutError, a 3-member cluster that keeps answering when the leader is killed
and stops answering (instead of deciding) without a quorum, and URL parsing.

The tests here start servers, network namespaces or the launcher (the system tier,
tests/python/tiers.py); the others are in test_etcd_store.py."""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from etcd_cluster import EtcdCluster
from resilient.etcd import EtcdStore, StoreUnreachableError, from_url
from resilient.store import as_store


@pytest.fixture
def etcd(tmp_path):
    with EtcdCluster(tmp_path, 1) as c:
        yield c


def test_store_contract_through_the_native_adapter(etcd):
    s = EtcdStore(etcd.endpoints, "run1/", timeout=timedelta(seconds=5))
    s.set("a", b"x\0y")
    assert s.get("a") == b"x\0y" and s.check(["a"]) and not s.check(["a", "b"])
    assert s.compare_set("b", b"", b"first") == b"first"
    assert s.compare_set("b", b"", b"second") == b"first"  # the first writer won
    assert s.compare_set("b", b"first", b"third") == b"third"
    assert s.compare_set("absent", b"something", b"v") == b"something"  # torch's semantics
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.num_keys() == 3 and s.delete_key("n") and not s.delete_key("n")
    other = EtcdStore(etcd.endpoints, "run2/")  # another run's keys are apart
    assert not other.check(["a"])
    native = as_store(s)
    native.set("k", b"v")
    assert native.get("k", 1.0) == b"v"
    assert native.compare_set("k", b"v", b"w") == b"w"
    with pytest.raises(KeyError):
        native.get("missing", 1.0, wait=False)
    with pytest.raises(TimeoutError):
        native.get("missing", 0.3)
    with pytest.raises(TimeoutError):
        s.wait(["never"], timedelta(seconds=0.3))
    threading.Timer(0.2, lambda: s.set("later", b"1")).start()
    s.wait(["later"], timedelta(seconds=5))  # another writer's set ends the wait


def test_add_and_compare_set_are_atomic_across_threads(etcd):
    s = EtcdStore(etcd.endpoints, "atomic/")
    won: list[bytes] = []

    def work(i: int) -> None:
        for _ in range(10):
            s.add("count", 1)
        won.append(s.compare_set("winner", b"", f"t{i}".encode()))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert s.get("count") == b"80"
    assert len(set(won)) == 1 and len(won) == 8  # one winner, seen by everyone


def test_an_add_applied_but_unanswered_counts_once(etcd):
    """etcd applies the txn but the reply is lost (a timeout): the retry on the next member
    finds the revision changed, and the receipt shows the first try counted."""
    s = EtcdStore(etcd.endpoints * 2, "lost/", timeout=timedelta(seconds=5))
    s.add("n", 1)
    real, lost = s._request, []

    def flaky(host, port, path, body, left):
        reply = real(host, port, path, body, left)
        if path == "/v3/kv/txn" and not lost:
            lost.append(reply)
            raise TimeoutError("reply lost")
        return reply

    s._request = flaky
    assert s.add("n", 5) == 6 and lost
    assert s.get("n") == b"6"
    assert s.num_keys() == 1  # the receipt is gone


def _rank(rank: int, endpoints: list[str], root: str, out: dict) -> None:
    import resilient
    import resilient.etcd  # noqa: F401 -- registers the etcd:// rendezvous

    url = f"etcd://{','.join(endpoints)}/pg/"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    # the default group's store is etcd: the checkpointer agrees and commits through it
    with resilient.Checkpointer(root, create=True) as ck:
        ck.save(1, {"w": torch.arange(4.0)}, {"r": torch.tensor([rank])}).wait()
        w, r = {"w": torch.zeros(4)}, {"r": torch.tensor([-1])}
        ck.load(w, r)
    out[rank] = (float(t), w["w"].tolist(), int(r["r"]))
    dist.destroy_process_group()


def test_a_gloo_group_and_a_checkpoint_through_etcd(etcd, tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        out = m.dict()
        procs = [ctx.Process(target=_rank, args=(r, etcd.endpoints, str(tmp_path / "c"), out))
                 for r in range(2)]
        [p.start() for p in procs]
        [p.join(90) for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert dict(out) == {r: (3.0, [0.0, 1.0, 2.0, 3.0], r) for r in range(2)}
    s = EtcdStore(etcd.endpoints, "pg/")
    assert s.num_keys() > 0  # the group's and the checkpointer's keys are in etcd


def test_a_dead_or_frozen_server_is_a_bounded_error(etcd):
    s = EtcdStore(etcd.endpoints, timeout=timedelta(seconds=1))
    s.set("a", b"1")
    etcd.signal(0, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        s.set("b", b"1")
    assert time.monotonic() - t0 < 3
    with pytest.raises(TimeoutError):  # the native adapter: a timeout
        as_store(s).set("c", b"1")
    etcd.signal(0, signal.SIGCONT)
    assert s.get("a") == b"1"
    etcd.kill(0)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        s.get("a")
    assert time.monotonic() - t0 < 3


@pytest.mark.timeout(120)
def test_three_members_survive_the_leaders_death_and_a_minority_does_not_decide(tmp_path):
    with EtcdCluster(tmp_path, 3) as c:
        s = EtcdStore(c.endpoints, "ha/", timeout=timedelta(seconds=5))
        s.set("before", b"1")
        leader = c.leader()
        c.kill(leader)
        t0 = time.monotonic()
        assert s.compare_set("after", b"", b"2") == b"2"  # a new leader, found in time
        assert s.get("before") == b"1"
        took = time.monotonic() - t0
        assert took < 5, took
        survivors = [i for i in range(3) if i != leader]
        c.kill(survivors[0])  # one member left: no quorum
        alone = EtcdStore([c.endpoints[survivors[1]]], "ha/", timeout=timedelta(seconds=1.5))
        with pytest.raises((TimeoutError, ConnectionError)):
            alone.compare_set("split", b"", b"minority")  # it cannot decide alone


@pytest.mark.timeout(120)
def test_a_cluster_without_quorum_fails_each_call_within_the_reach_timeout(tmp_path):
    """The process group's 30 min is the bound of waiting for a key, not of reaching the
    cluster: with 2 of 3 members killed every call fails within reach_timeout, as a torch store
    error (Recovery stops on it), the next ones faster; a missing key on a healthy cluster is
    still waited for up to the call's own timeout."""
    with EtcdCluster(tmp_path, 3) as c:
        s = EtcdStore(c.endpoints, "q/", timeout=timedelta(minutes=30),
                      reach_timeout=timedelta(seconds=2))
        s.set("a", b"1")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            s.wait(["never"], timedelta(seconds=4))  # waited for, not unreachable
        assert time.monotonic() - t0 > 3.5  # longer than reach_timeout
        assert s.probe(5.0) is None
        leader = c.leader()
        c.kill(leader)
        c.kill(next(i for i in range(3) if i != leader))
        t0 = time.monotonic()
        with pytest.raises(StoreUnreachableError) as err:
            s.add("n", 1)
        took = time.monotonic() - t0
        assert 1.5 < took < 10, took
        assert isinstance(err.value, (TimeoutError, ConnectionError))
        assert isinstance(err.value, dist.DistError)  # what torch's stores raise, and Recovery
        t0 = time.monotonic()
        with pytest.raises(StoreUnreachableError):
            s.get("a")
        why = s.probe(1.0)
        assert why and "did not answer" in why, why
        assert time.monotonic() - t0 < 10
        with pytest.raises(TimeoutError):  # the native adapter: a timeout
            as_store(s).set("c", b"1")
    assert from_url("etcd://h1:1/j?reach_timeout=2.5")._reach == 2.5
    with pytest.raises(ValueError, match="reach_timeout"):
        from_url("etcd://h1:1/j?reach_timeout=0")


def _post(port: int, path: str, body: dict, token: str | None = None) -> dict:
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    headers = {"Authorization": token} if token else {}
    conn.request("POST", path, json.dumps(body), headers)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    assert resp.status == 200, (path, resp.status, data)
    return data


def test_etcd_authentication(etcd):
    port = int(etcd.endpoints[0].split(":")[1])
    _post(port, "/v3/auth/role/add", {"name": "root"})
    _post(port, "/v3/auth/user/add", {"name": "root", "password": "pw-123"})
    _post(port, "/v3/auth/user/grant", {"user": "root", "role": "root"})
    _post(port, "/v3/auth/enable", {})
    s = EtcdStore(etcd.endpoints, "auth/", user="root", password="pw-123",
                  timeout=timedelta(seconds=5))
    s.set("a", b"1")
    assert s.get("a") == b"1" and s.add("n", 1) == 1
    s._token = "expired-or-forged"  # a rejected token is renewed once
    assert s.get("a") == b"1"
    with pytest.raises(PermissionError) as err:
        EtcdStore(etcd.endpoints, "auth/", user="root", password="wrong-pw").set("b", b"1")
    assert "wrong-pw" not in str(err.value)
    with pytest.raises(PermissionError):
        EtcdStore(etcd.endpoints, "auth/").set("c", b"1")  # no user: refused
