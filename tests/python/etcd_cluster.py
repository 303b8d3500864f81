"""Real etcd servers for tests: a cluster of n members on 127.0.0.1 (free ports, a temporary
data directory each), started and stopped by the test, every wait bounded."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from resilient.ports import free_ports

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def status(port: int, timeout: float = 1.0) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v3/maintenance/status", "{}")
        resp = conn.getresponse()
        return json.loads(resp.read())
    finally:
        conn.close()


class EtcdCluster:
    """`with EtcdCluster(tmp_path, 3) as c:` ... c.endpoints, c.kill(i), c.leader()."""

    def __init__(self, root: Path, members: int = 1) -> None:
        if not os.path.exists(ETCD):
            raise AssertionError("etcd is not installed (scripts/setup.sh installs etcd-server)")
        self.root, self.n = Path(root), members
        ports = free_ports(2 * members)
        self.client, self.peer = ports[:members], ports[members:]
        self.procs: list[subprocess.Popen | None] = [None] * members

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client]

    def __enter__(self) -> EtcdCluster:
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer))
        for i in range(self.n):
            log = open(self.root / f"etcd{i}.log", "w")
            self.procs[i] = subprocess.Popen(
                [ETCD, "--name", f"m{i}", "--data-dir", str(self.root / f"etcd{i}"),
                 "--listen-client-urls", f"http://127.0.0.1:{self.client[i]}",
                 "--advertise-client-urls", f"http://127.0.0.1:{self.client[i]}",
                 "--listen-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"t{self.peer[0]}",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_leader(30)
        return self

    def wait_leader(self, timeout: float) -> int:
        """Index of the leader, once every live member agrees there is one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                leaders = {status(self.client[i]).get("leader") for i in range(self.n)
                           if self.procs[i] is not None}
                if len(leaders) == 1 and None not in leaders and "0" not in leaders:
                    return self.leader()
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"etcd has no leader after {timeout} s: {self.logs()}")

    def leader(self) -> int:
        for i in range(self.n):
            if self.procs[i] is None:
                continue
            s = status(self.client[i])
            if s.get("leader") == s.get("header", {}).get("member_id"):
                return i
        raise AssertionError("no member is the leader")

    def signal(self, i: int, sig: int) -> None:
        p = self.procs[i]
        assert p is not None
        os.killpg(p.pid, sig)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
            self.procs[i] = None

    def logs(self) -> str:
        return "\n".join((self.root / f"etcd{i}.log").read_text()[-1500:] for i in range(self.n)
                         if (self.root / f"etcd{i}.log").exists())

    def __exit__(self, *exc: object) -> None:
        for i in range(self.n):
            p = self.procs[i]
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.kill(i)
