"""``--rdzv-backend etcd-v3``: torch elastic's dynamic rendezvous with its state on a real etcd
cluster (resilient.etcd_rendezvous). The backend's compare-and-swap contract; two agents of
``resilient run`` meeting on a 3-member cluster whose leader was killed first (no member is a
single point of failure for the agents); plain ``torchrun`` finding the backend through its
``torchrun.handlers`` entry point.

The tests here start servers, network namespaces or the launcher (the system tier,
tests/python/tiers.py); the others are in test_etcd_rendezvous.py."""


from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from etcd_cluster import EtcdCluster
from procs import wait_or_kill
from resilient.etcd import EtcdStore
from resilient.etcd_rendezvous import EtcdRendezvousBackend

SCRIPT = """\
import os, sys, time, torch, torch.distributed as dist
cue = sys.argv[2] if len(sys.argv) > 2 else None
failed = cue is not None and os.path.exists(os.path.join(cue, "failed"))
if cue is not None and not failed:  # before the failure: wait for the test's cue, rank 1 fails
    open(os.path.join(cue, f"started{os.environ['RANK']}"), "w").close()
    while not os.path.exists(os.path.join(cue, "go")):
        time.sleep(0.05)
    if os.environ["RANK"] == "1":
        open(os.path.join(cue, "failed"), "w").close()
        sys.exit(1)
    time.sleep(600)  # stopped by its agent for the next round
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as f:
    f.write(f"{dist.get_world_size()} {t.item()}" + (" after the failure" if failed else ""))
dist.destroy_process_group()
"""


def test_the_backend_swaps_the_state_on_its_revision(tmp_path: Path) -> None:
    with EtcdCluster(tmp_path, 1) as etcd:
        backend = EtcdRendezvousBackend(EtcdStore(etcd.endpoints, "t/",
                                                  timeout=timedelta(seconds=10)), "job")
        assert backend.name == "etcd-v3"
        fresh, token = backend.get_state()  # none yet: a new one, in a round of its own
        assert token is None and pickle.loads(fresh).round > 0 and not pickle.loads(fresh).closed
        state, first, mine = backend.set_state(b"a")
        assert (state, mine) == (b"a", True)
        assert backend.get_state() == (b"a", first)
        # Another agent that also saw no state loses, and gets the winner's state and token.
        assert backend.set_state(b"b") == (b"a", first, False)
        # A retried write that had been applied finds its own state (as torch's c10d backend).
        assert backend.set_state(b"a") == (b"a", first, True)
        state, second, mine = backend.set_state(b"c", first)
        assert (state, mine) == (b"c", True) and second != first
        assert backend.set_state(b"d", first) == (b"c", second, False)  # a stale token
        assert backend.get_state() == (b"c", second)
        other = EtcdRendezvousBackend(EtcdStore(etcd.endpoints, "t/"), "another-job")
        assert other.get_state()[1] is None  # runs are apart


def test_an_unreachable_cluster_is_torchs_connection_error(tmp_path: Path) -> None:
    """torch catches RendezvousError (shutdown at the end of a job, the keep-alive thread);
    anything else would escape them."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    with EtcdCluster(tmp_path, 1) as etcd:
        backend = EtcdRendezvousBackend(EtcdStore(etcd.endpoints, "t/",
                                                  timeout=timedelta(seconds=1)), "job")
        _, token, _ = backend.set_state(b"a")
        etcd.kill(0)
        with pytest.raises(RendezvousConnectionError, match="reading the state"):
            backend.get_state()
        with pytest.raises(RendezvousConnectionError, match="writing the state"):
            backend.set_state(b"b", token)


def _start(tmp_path: Path, launcher: list[str], endpoint: str, nodes: int,
           extra: list[str] = (), script_args: list[str] = ()) -> list[subprocess.Popen]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = []
    for n in range(nodes):
        log = open(tmp_path / f"agent{n}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, *launcher, "--nnodes", str(nodes), "--nproc-per-node", "1",
             "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", "job42",
             *extra, str(script), str(out), *script_args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    return procs


def _agents(tmp_path: Path, launcher: list[str], endpoint: str, nodes: int) -> list[int | None]:
    return [wait_or_kill(p, 90) for p in _start(tmp_path, launcher, endpoint, nodes)]


@pytest.mark.timeout(150)
def test_two_agents_meet_on_a_cluster_whose_leader_was_killed(tmp_path: Path) -> None:
    (tmp_path / "etcd").mkdir()
    with EtcdCluster(tmp_path / "etcd", 3) as cluster:
        cluster.wait_leader(30)
        cluster.kill(cluster.leader())
        endpoint = ",".join(cluster.endpoints)
        codes = _agents(tmp_path, ["-m", "resilient.run"], endpoint, 2)
        logs = "\n".join((tmp_path / f"agent{n}.log").read_text()[-3000:] for n in range(2))
        assert codes == [0, 0], logs
    results = sorted(p.read_text() for p in (tmp_path / "out").iterdir())
    assert results == ["2 3.0", "2 3.0"], results


@pytest.mark.timeout(120)
def test_plain_torchrun_finds_the_backend_through_its_entry_point(tmp_path: Path) -> None:
    (tmp_path / "etcd").mkdir()
    with EtcdCluster(tmp_path / "etcd", 1) as etcd:
        url = "etcd://" + etcd.endpoints[0] + "/tr"
        codes = _agents(tmp_path, ["-m", "torch.distributed.run"], url, 1)
        assert codes == [0], (tmp_path / "agent0.log").read_text()[-3000:]
    assert (tmp_path / "out" / "rank0").read_text() == "1 1.0"


@pytest.mark.timeout(200)
def test_the_agents_restart_through_etcd_after_its_leader_died(tmp_path: Path) -> None:
    """A worker fails (no in-process recovery, one restart allowed) after the etcd leader was
    SIGKILLed: the agents' next rendezvous round goes through the two members left, and the
    second attempt of both ranks completes its all-reduce."""
    cue = tmp_path / "cue"
    cue.mkdir()
    (tmp_path / "etcd").mkdir()
    with EtcdCluster(tmp_path / "etcd", 3) as cluster:
        cluster.wait_leader(30)
        procs = _start(tmp_path, ["-m", "resilient.run"], ",".join(cluster.endpoints), 2,
                       ["--max-restarts", "1", "--no-in-process-recovery"], [str(cue)])
        try:
            deadline = time.monotonic() + 90
            while not ((cue / "started0").exists() and (cue / "started1").exists()):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
                time.sleep(0.05)
            cluster.kill(cluster.leader())
            (cue / "go").touch()
        finally:
            codes = [wait_or_kill(p, 120) for p in procs]
        logs = "\n".join((tmp_path / f"agent{n}.log").read_text()[-3000:] for n in range(2))
        assert codes == [0, 0], logs
    results = sorted(p.read_text() for p in (tmp_path / "out").iterdir())
    assert results == ["2 3.0 after the failure"] * 2, results


def _params(etcd: EtcdCluster, run_id: str, **conf: object):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(backend="etcd-v3", endpoint=",".join(etcd.endpoints),
                                run_id=run_id, min_nodes=1, max_nodes=1, **conf)


def test_a_closed_rendezvous_does_not_refuse_the_next_launch(tmp_path: Path) -> None:
    """A finished launch closes its rendezvous: its own node still finds it closed (torch's
    RendezvousClosedError), but the next launch of the same run id meets at once, in a round
    numbered above every earlier one (torch names a round's keys by its number: none of the
    first launch's keys is read), and the rendezvous's keys are on the agents' lease."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from resilient.etcd_rendezvous import create_etcd_v3_handler

    with EtcdCluster(tmp_path, 1) as etcd:
        first = create_etcd_v3_handler(_params(etcd, "same", ttl=3))
        info = first.next_rendezvous()
        info.store.set("written-in-round", b"first")
        first_round = first._state_holder.state.round
        first.shutdown()
        with pytest.raises(RendezvousClosedError):
            first.next_rendezvous()
        t0 = time.monotonic()
        again = create_etcd_v3_handler(_params(etcd, "same", ttl=3))
        info = again.next_rendezvous()
        assert time.monotonic() - t0 < 10
        assert again._state_holder.state.round > first_round
        assert not info.store.check(["written-in-round"])  # the first launch's keys are apart
        again.shutdown()
        keys = EtcdStore(etcd.endpoints, "")._post("/v3/kv/range", {
            "key": "dG9yY2hlbGFzdGljLw==", "range_end": "dG9yY2hlbGFzdGljMA=="})  # torchelastic/
        assert keys.get("kvs") and all(kv.get("lease") for kv in keys["kvs"]), keys
