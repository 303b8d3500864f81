"""The job's store on a 3-member etcd cluster (resilient.etcd.EtcdStore): compare_set latency,
and the time from SIGKILL of the leader to the next answered compare_set, over several fresh
clusters on 127.0.0.1 (tests/python/etcd_cluster.py starts them).

    python benchmarks/etcd_failover.py [--runs 5] [--timeout 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

from etcd_cluster import EtcdCluster  # noqa: E402
from resilient.etcd import EtcdStore  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=10.0, help="the store's call timeout (s)")
    a = p.parse_args()
    failover, latency = [], []
    for _ in range(a.runs):
        with tempfile.TemporaryDirectory() as d, EtcdCluster(Path(d), 3) as c:
            s = EtcdStore(c.endpoints, "bench/", timeout=timedelta(seconds=a.timeout))
            t = time.perf_counter()
            for k in range(200):
                s.compare_set(f"k{k}", b"", b"v")
            latency.append((time.perf_counter() - t) / 200)
            c.kill(c.leader())
            t0 = time.perf_counter()
            s.compare_set("after", b"", b"1")
            failover.append(time.perf_counter() - t0)
    print("compare_set latency ms:", [round(x * 1e3, 2) for x in latency],
          "median", round(statistics.median(latency) * 1e3, 2))
    print("leader SIGKILL -> next compare_set s:", [round(x, 3) for x in failover],
          "median", round(statistics.median(failover), 3))


if __name__ == "__main__":
    main()
