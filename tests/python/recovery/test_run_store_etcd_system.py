"""``resilient run --store etcd://...``: an unmodified script's ``init_process_group("gloo")``
(env://) rendezvouses on a real 3-member etcd cluster, and with it the failure detector, the
recovery gate and the checkpoint's collective entries; a rank SIGKILLed mid-run is recovered
from through etcd. A URL that is not etcd's is refused before anything starts.

The tests here start servers, network namespaces or the launcher (the system tier,
tests/python/tiers.py); the others are in test_run_store_etcd.py."""


from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_quickstart_recovery import (  # noqa: E402
    RECOVERABLE,
    ROOT,
    _launch,
    kill_rank1_after,
)
from test_quickstart_recovery_system import _samples

from etcd_cluster import EtcdCluster  # noqa: E402
from procs import kill_mentioning, wait_or_kill  # noqa: E402


@pytest.mark.timeout(240)
def test_an_unmodified_script_recovers_through_etcd(tmp_path: Path) -> None:
    (tmp_path / "samples").mkdir()
    steps = 30
    (tmp_path / "etcd").mkdir()
    with EtcdCluster(tmp_path / "etcd", 3) as cluster:
        cluster.wait_leader(30)
        url = "etcd://" + ",".join(cluster.endpoints) + "/job42"
        p = _launch(tmp_path, RECOVERABLE, ["-m", "resilient.run", "--standalone",
                                            "--nproc-per-node", "4", "--store", url], steps)
        keys: set[str] = set()
        try:
            kill_rank1_after(tmp_path, 6)
            deadline = time.monotonic() + 150
            while p.poll() is None and time.monotonic() < deadline:  # the job's keys as it runs
                keys.update(_keys(cluster.endpoints[0], "job42/"))
                time.sleep(0.3)
        finally:
            code = wait_or_kill(p, 150)
        log_text = (tmp_path / "launcher.log").read_text()
        assert code == 0, log_text[-6000:]
        assert "default process group's store is a" not in log_text, log_text[-6000:]
        assert _keys(cluster.endpoints[0], "job42/") == []  # the job succeeded: all deleted
    per_step, seen, ran = _samples(tmp_path)
    assert sorted(per_step) == list(range(steps))
    killed_at = len(ran[1])
    assert all(per_step[s] == 24 for s in range(killed_at, steps)), per_step
    assert len(seen) == sum(per_step.values())  # no sample twice
    # What went through etcd: the detector's records, the rebuild gate, the checkpoint entries.
    for part in ("/resilient/detect/", "/resilient-gate/", "/resilient/ckpt/"):
        assert any(part in k for k in keys), (part, keys[:20])


@pytest.mark.timeout(240)
def test_losing_the_etcd_quorum_stops_every_rank_within_bounds(tmp_path: Path) -> None:
    """2 of the 3 members SIGKILLed mid-run (the leader among them): no rank can reach a
    quorum, so each stops with "the job's store is unreachable" at its next store call (the
    checkpoint every 5 steps), within the store's reach timeout (15 s) and the probe's 2 s, and
    the launcher fails the job. Before, each rank hung in that call for the process group's
    30 minutes (the store's per-call timeout)."""
    import re

    (tmp_path / "samples").mkdir()
    (tmp_path / "etcd").mkdir()
    with EtcdCluster(tmp_path / "etcd", 3) as cluster:
        url = "etcd://" + ",".join(cluster.endpoints) + "/job42"
        p = _launch(tmp_path, RECOVERABLE, ["-m", "resilient.run", "--standalone",
                                            "--nproc-per-node", "3", "--store", url], 100_000)
        try:
            victim = tmp_path / "samples" / "rank1.samples"
            deadline = time.monotonic() + 120
            while not (victim.exists() and len(victim.read_text().splitlines()) >= 12):
                assert p.poll() is None and time.monotonic() < deadline, "no training"
                time.sleep(0.02)
            leader = cluster.leader()
            cluster.kill(leader)
            cluster.kill(next(i for i in range(3) if i != leader))
            t0 = time.monotonic()
        finally:
            code = wait_or_kill(p, 150)
            took = time.monotonic() - t0
            kill_mentioning(str(tmp_path))
    log_text = (tmp_path / "launcher.log").read_text()
    assert code == 1, log_text[-6000:]
    stopped = re.findall(r"\[rank(\d)\]: resilient.errors.RecoveryStopped: the job's "
                         r"store is unreachable", log_text)
    assert sorted(stopped) == ["0", "1", "2"], log_text[-6000:]
    assert "cannot reach a majority of the etcd cluster" in log_text, log_text[-6000:]
    assert "fatal signal" not in log_text, log_text[-6000:]  # no crash on the way out
    assert took < 90, took  # 15 s reach + 2 s probe + exit: ~21 s here; hung 30 min before


@pytest.mark.parametrize("url", ["tcp://h1:2379", "etcd://h1:2379/?bogus=1"])
def test_a_store_that_is_not_etcd_is_refused(url: str) -> None:
    r = subprocess.run([sys.executable, "-m", "resilient.run", "--standalone", "--store", url,
                        "x.py"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--store" in r.stderr, r.stderr


def _keys(endpoint: str, prefix: str) -> list[str]:
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                       "range_end": base64.b64encode(end.encode()).decode(),
                       "keys_only": True}).encode()
    req = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=body)
    with urllib.request.urlopen(req, timeout=10) as r:
        return [base64.b64decode(kv["key"]).decode() for kv in json.load(r).get("kvs", [])]


def _run_dir(tmp: Path, name: str) -> Path:
    d = tmp / name
    (d / "samples").mkdir(parents=True)
    return d


@pytest.mark.timeout(400)
@pytest.mark.parametrize("rdzv", ["etcd-v3", "c10d"])
def test_the_same_command_twice_and_after_a_kill9(tmp_path: Path, rdzv: str) -> None:
    """docs/store.md's command (`--rdzv-id job42 --store etcd://.../job42`, the agents' rendezvous
    on etcd or on a c10d endpoint) run twice in a row, then once more killed with SIGKILL mid-run
    (launcher and workers), then again: every launch that was not killed succeeds, each one
    on keys of its own (before: the second hung, its ranks reading the first launch's gloo
    addresses, or etcd-v3 refused it as closed for two hours). A launch that succeeded leaves no
    key under the store's prefix; the killed one's expire with its lease (--store-ttl-s 5)."""
    from procs import kill_mentioning as kill_all
    from resilient.ports import free_port

    (tmp_path / "etcd").mkdir()
    with EtcdCluster(tmp_path / "etcd", 3) as cluster:
        members = ",".join(cluster.endpoints)
        endpoint = members if rdzv == "etcd-v3" else f"127.0.0.1:{free_port()}"
        command = ["-m", "resilient.run", "--nnodes", "1", "--nproc-per-node", "2",
                   "--rdzv-backend", rdzv, "--rdzv-endpoint", endpoint, "--rdzv-id", "job42",
                   "--store", f"etcd://{members}/job42", "--store-ttl-s", "5"]

        def run(name: str, steps: int) -> tuple[Path, subprocess.Popen]:
            d = _run_dir(tmp_path, name)
            return d, _launch(d, RECOVERABLE, command, steps)

        for name in ("first", "second"):
            d, p = run(name, 10)
            code = wait_or_kill(p, 150)
            kill_all(str(d))
            assert code == 0, (name, (d / "launcher.log").read_text()[-6000:])
            assert _keys(cluster.endpoints[0], "job42/") == [], name  # its lease revoked
        d, p = run("killed", 100_000)
        try:
            victim = d / "samples" / "rank1.samples"
            deadline = time.monotonic() + 120
            while not (victim.exists() and len(victim.read_text().splitlines()) >= 3):
                assert p.poll() is None and time.monotonic() < deadline, "no training"
                time.sleep(0.02)
        finally:
            p.kill()  # the launcher, then its workers (sessions of their own): a lost node
            p.wait(10)
            kill_all(str(d))
        assert _keys(cluster.endpoints[0], "job42/"), "the killed launch wrote nothing?"
        d, p = run("after-the-kill", 10)
        code = wait_or_kill(p, 150)
        kill_all(str(d))
        assert code == 0, (d / "launcher.log").read_text()[-6000:]
        deadline = time.monotonic() + 60
        while _keys(cluster.endpoints[0], "job42/"):  # the killed launch's lease expires
            assert time.monotonic() < deadline, _keys(cluster.endpoints[0], "job42/")[:10]
            time.sleep(0.5)
