"""Detector tests over a veth link into a network namespace (needs root and `ip netns`):
partition one rank, and a slow lossy link with tc netem. Ranks 0-2 run on the host side, rank 3
inside the namespace; the store stays on the host side."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from test_detect_multiproc import Cluster

pytestmark = pytest.mark.netns


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=20)


@pytest.fixture
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    tag = f"{os.getpid() % 100000}"
    ns, vh, vn = f"rsdt{tag}", f"rsh{tag}", f"rsn{tag}"
    sub = 200 + os.getpid() % 50
    host_ip, ns_ip = f"10.{sub}.77.1", f"10.{sub}.77.2"
    if _run("ip", "netns", "add", ns, check=False).returncode != 0:
        pytest.skip("ip netns unavailable")
    try:
        _run("ip", "link", "add", vh, "type", "veth", "peer", "name", vn)
        _run("ip", "link", "set", vn, "netns", ns)
        _run("ip", "addr", "add", f"{host_ip}/24", "dev", vh)
        _run("ip", "link", "set", vh, "up")
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/24", "dev", vn)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", vn, "up")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield {"ns": ns, "vh": vh, "vn": vn, "host_ip": host_ip, "ns_ip": ns_ip}
    finally:
        _run("ip", "link", "del", vh, check=False)
        _run("ip", "netns", "del", ns, check=False)


def _cluster(tmp_path, n):
    hosts = [n["host_ip"]] * 3 + [n["ns_ip"]]
    prefixes = [[]] * 3 + [["ip", "netns", "exec", n["ns"]]]
    c = Cluster(tmp_path, 4, hosts=hosts, prefixes=prefixes, store_host=n["host_ip"])
    c.wait_started()
    time.sleep(1.5)
    return c


def test_partitioned_rank_is_removed_by_the_majority_side(tmp_path, netns):
    c = _cluster(tmp_path, netns)
    try:
        t0 = time.time()
        _run("ip", "netns", "exec", netns["ns"], "ip", "link", "set", netns["vn"], "down")
        dt, seen = c.wait_verdict([0, 1, 2], {3}, t0, timeout=10)
        print(f"\n[detect] partition rank 3: ranks 0-2 agreed in {dt * 1e3:.0f} ms")
        assert len(set(seen.values())) == 1
        assert dt <= 3.5
        reasons = {x["reason"] for e in c.events(0) if e["kind"] == "generation"
                   for x in e["removed"]}
        assert reasons == {"unresponsive"}
    finally:
        c.close()


def test_slow_lossy_link_causes_no_false_removal(tmp_path, netns):
    add = _run("tc", "qdisc", "add", "dev", netns["vh"], "root", "netem", "delay", "40ms",
               "20ms", "loss", "5%", check=False)
    if add.returncode != 0:
        pytest.skip(f"tc netem unavailable (sch_netem missing?): {add.stderr.strip()}")
    c = _cluster(tmp_path, netns)
    try:
        time.sleep(10)
        for r in range(4):
            gens = [e for e in c.events(r) if e["kind"] == "generation"]
            assert not gens, f"rank {r} removed someone over a slow link: {gens}"
        # ...and a crash behind the slow link is still found.
        t0 = time.time()
        c.procs[3].kill()
        dt, _ = c.wait_verdict([0, 1, 2], {3}, t0, timeout=10)
        print(f"\n[detect] kill -9 over netem link: agreed in {dt * 1e3:.0f} ms")
    finally:
        c.close()
