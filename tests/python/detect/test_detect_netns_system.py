"""Detector tests over a veth link into a network namespace (needs root and `ip netns`):
partition one rank, a slow lossy link with tc netem, spoofed ICMP port-unreachable, and datagrams
recorded in one run and replayed in the next. Ranks 0-2 run on the host side, rank 3 inside the
namespace; the store stays on the host side."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
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


def _cluster(tmp_path, n, store=None):
    hosts = [n["host_ip"]] * 3 + [n["ns_ip"]]
    prefixes = [[]] * 3 + [["ip", "netns", "exec", n["ns"]]]
    tmp_path.mkdir(parents=True, exist_ok=True)
    c = Cluster(tmp_path, 4, hosts=hosts, prefixes=prefixes, store_host=n["host_ip"],
                store=store)
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


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _watch_sockets(c: Cluster, peer_ip: str, peer_port: int) -> dict[int, int]:
    """{rank: local port} of the host-side ranks' connected sockets watching peer_ip:peer_port."""
    out = _run("ss", "-uanpH", "dst", f"{peer_ip}:{peer_port}").stdout
    pids = {p.pid: r for r, p in enumerate(c.procs)}
    found = {}
    for line in out.splitlines():
        pid = re.search(r"pid=(\d+)", line)
        local = line.split()[3]
        if pid and int(pid.group(1)) in pids:
            found[pids[int(pid.group(1))]] = int(local.rsplit(":", 1)[1])
    return found


# Sends raw datagrams from inside the namespace: argv = mode, seconds, then jobs as JSON lines on
# stdin. "icmp": ICMP port unreachable quoting (src_ip, src_port) -> (dst_ip, dst_port);
# "udp": UDP payload (hex) with a chosen source port. Every 10 ms, for `seconds` at most.
_SENDER = r"""
import json, socket, struct, sys, time
def csum(d):
    if len(d) % 2: d += b"\0"
    t = sum(struct.unpack(f"!{len(d)//2}H", d)); t = (t >> 16) + (t & 0xFFFF); t += t >> 16
    return ~t & 0xFFFF
mode, seconds = sys.argv[1], float(sys.argv[2])
jobs = [json.loads(x) for x in sys.stdin if x.strip()]
proto = socket.IPPROTO_ICMP if mode == "icmp" else socket.IPPROTO_UDP
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, proto)
pkts = []
for j in jobs:
    if mode == "icmp":
        inner_ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28, 0, 0, 64, 17, 0,
                               socket.inet_aton(j["src"]), socket.inet_aton(j["dst"]))
        inner = inner_ip + struct.pack("!HHHH", j["sport"], j["dport"], 8 + 40, 0)
        body = struct.pack("!BBHI", 3, 3, 0, 0) + inner
        body = body[:2] + struct.pack("!H", csum(body)) + body[4:]
        pkts.append((body, j["src"]))
    else:
        payload = bytes.fromhex(j["hex"])
        udp = struct.pack("!HHHH", j["sport"], j["dport"], 8 + len(payload), 0) + payload
        pkts.append((udp, j["dst"]))
end = time.monotonic() + seconds
while time.monotonic() < end:
    for body, dst in pkts:
        s.sendto(body, (dst, 0))
    time.sleep(0.01)
"""


def _send_from_ns(ns: str, mode: str, seconds: float, jobs: list[dict]) -> subprocess.Popen:
    import json

    p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _SENDER, mode,
                          str(seconds)], stdin=subprocess.PIPE, text=True)
    p.stdin.write("\n".join(json.dumps(j) for j in jobs))
    p.stdin.close()
    return p


def test_spoofed_icmp_port_unreachable_evicts_nobody(tmp_path, netns):
    """Finding 1: ICMP port unreachable needs no key. A flood of spoofed ones, quoting each
    watcher's connected socket to rank 3, must not remove rank 3 (which keeps answering)."""
    c = _cluster(tmp_path, netns)
    sender = None
    try:
        port3 = c.port(3)
        watchers = _watch_sockets(c, netns["ns_ip"], port3)
        assert set(watchers) == {0, 1, 2}, watchers
        jobs = [{"src": netns["host_ip"], "sport": p, "dst": netns["ns_ip"], "dport": port3}
                for p in watchers.values()]
        sender = _send_from_ns(netns["ns"], "icmp", 3.0, jobs)
        sender.wait(timeout=20)
        time.sleep(1.0)
        for r in range(4):
            gens = [e for e in c.events(r) if e["kind"] == "generation"]
            assert not gens, f"rank {r} acted on spoofed ICMP: {gens}"
        refused = {r: c.metrics(r).get("refusals", 0) for r in range(3)}
        print(f"\n[detect] spoofed ICMP: refusals seen by watchers {refused}, nobody removed")
        assert all(n > 0 for n in refused.values()), refused  # the spoof did arrive
        # ...and a real kill behind the same link is still found fast.
        t0 = time.time()
        c.procs[3].kill()
        dt, _ = c.wait_verdict([0, 1, 2], {3}, t0, timeout=10)
        print(f"[detect] kill -9 over veth after the spoof: agreed in {dt * 1e3:.0f} ms")
        assert dt <= 1.5
    finally:
        if sender is not None and sender.poll() is None:
            sender.kill()
        c.close()


class _Capture:
    """Records the UDP payloads leaving the namespace (AF_PACKET on the host end of the veth)."""

    def __init__(self, ifname: str, src_ip: str) -> None:
        self.payloads: list[bytes] = []
        self._src = socket.inet_aton(src_ip)
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0800))
        self._sock.bind((ifname, 0))
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self._sock.recv(65535)
            except TimeoutError:
                continue
            ip = frame[14:]
            ihl = (ip[0] & 0xF) * 4
            if ip[9] == 17 and ip[12:16] == self._src:
                self.payloads.append(ip[ihl + 8:])

    def stop(self) -> list[bytes]:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        return self.payloads


def test_datagrams_replayed_from_an_earlier_run_and_this_one_keep_nobody_alive(tmp_path, netns):
    """Finding 3: run A and run B share the store and job name. Everything rank 3 sent in run A,
    and in run B before it froze, is replayed at its watchers from rank 3's own address while it
    is stopped: all of it is dropped and counted, and rank 3 is removed as usual."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(netns["host_ip"], 0, 4, is_master=True,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    a = _cluster(tmp_path / "a", netns, store=store)
    try:
        cap = _Capture(netns["vh"], netns["ns_ip"])
        time.sleep(1.0)
        recorded_a = cap.stop()
    finally:
        a.close()
    b = _cluster(tmp_path / "b", netns, store=store)
    sender = None
    try:
        run_a = next(e["run_id"] for e in a.events(0) if e["kind"] == "start")
        run_b = next(e["run_id"] for e in b.events(0) if e["kind"] == "start")
        assert run_a != run_b
        cap = _Capture(netns["vh"], netns["ns_ip"])
        time.sleep(1.0)
        recorded_b = cap.stop()
        assert len(recorded_a) > 20 and len(recorded_b) > 20
        port3 = b.port(3)
        ports = {r: b.port(r) for r in range(3)}
        watch = _watch_sockets(b, netns["ns_ip"], port3)
        jobs = []
        for payload in recorded_a + recorded_b:
            to = struct.unpack_from("<i", payload, 28)[0] if len(payload) > 32 else 0
            if not 0 <= to < 3:
                continue
            dport = watch.get(to) if payload[5] == 2 else ports[to]  # acks: watcher socket
            if dport:
                jobs.append({"hex": payload.hex(), "sport": port3, "dst": netns["host_ip"],
                             "dport": dport})
        t0 = time.time()
        os.kill(b.procs[3].pid, signal.SIGSTOP)
        sender = _send_from_ns(netns["ns"], "udp", 5.0, jobs)
        dt, _ = b.wait_verdict([0, 1, 2], {3}, t0, timeout=10)
        time.sleep(0.5)
        m = {r: b.metrics(r) for r in range(3)}
        other_run = sum(x.get("dropped_other_run", 0) for x in m.values())
        replay = sum(x.get("dropped_replay", 0) + x.get("dropped_stale", 0) for x in m.values())
        print(f"\n[detect] SIGSTOP under replay: agreed in {dt * 1e3:.0f} ms; dropped "
              f"{other_run} from run A, {replay} replays from run B")
        assert dt <= 3.5
        assert other_run > 0 and replay > 0, m
    finally:
        if sender is not None and sender.poll() is None:
            sender.kill()
        b.close()
        store = None
