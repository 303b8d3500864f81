"""Detector soak: N ranks (subprocesses) heartbeat for a while on loopback, optionally under a
stress-ng CPU load, and must suspect nobody. Prints a JSON summary; exit 1 on any false suspicion.
The store is a TCPStore, or with --etcd M an M-member etcd cluster on 127.0.0.1 reached through
the native client (resilient.store.connect_store), as a job with `--store etcd://...` runs.

    python benchmarks/detector_soak.py --ranks 8 --minutes 10 --stress-cpu 2 [--etcd 3]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(store_addr: str, rank: int, world: int, seconds: float, out: str) -> int:
    import torch.distributed as dist

    from resilient.detect import FailureDetector

    if store_addr.startswith("etcd://"):
        from resilient.store import connect_store

        store = connect_store(store_addr)
    else:
        host, port = store_addr.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
    det = FailureDetector(store, rank, world, job="soak", host="127.0.0.1", event_log=out)
    det.start()
    end = time.monotonic() + seconds
    step = 0
    max_phi = 0.0
    while time.monotonic() < end:
        step += 1
        det.step(step)
        time.sleep(0.05)
        if step % 20 == 0:
            max_phi = max([max_phi] + [p["phi"] for p in det.metrics()["peers"]])
    m = det.metrics()
    det.stop()
    with open(out, "a") as f:
        f.write(json.dumps({"kind": "summary", "max_phi": max_phi, **{
            k: m[k] for k in ("suspicions", "generations", "pings_sent", "acks_received",
                              "dropped_bad_mac", "dropped_malformed")}}) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--stress-cpu", type=int, default=2, help="stress-ng --cpu N (0: none)")
    p.add_argument("--etcd", type=int, default=0, help="an etcd cluster of this many members as "
                   "the store (0: a TCPStore)")
    p.add_argument("--worker", nargs=5, metavar=("STORE", "RANK", "WORLD", "SECONDS", "OUT"))
    a = p.parse_args()
    if a.worker:
        s, r, w, sec, out = a.worker
        return worker(s, int(r), int(w), float(sec), out)
    import torch.distributed as dist

    seconds = a.minutes * 60
    tmp = Path(tempfile.mkdtemp(prefix="detect-soak-"))
    with contextlib.ExitStack() as stack:
        if a.etcd:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
            from etcd_cluster import EtcdCluster

            (tmp / "etcd").mkdir()
            cluster = stack.enter_context(EtcdCluster(tmp / "etcd", a.etcd))
            addr = "etcd://" + ",".join(cluster.endpoints) + "/soak/"
        else:
            store = dist.TCPStore("127.0.0.1", 0, a.ranks, is_master=True,
                                  timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
            addr = f"127.0.0.1:{store.port}"
        ok = _soak(a, addr, seconds, tmp)
    return 0 if ok else 1


def _soak(a: argparse.Namespace, addr: str, seconds: float, tmp: Path) -> bool:
    procs = []
    stress = None
    try:
        if a.stress_cpu and shutil.which("stress-ng"):
            stress = subprocess.Popen(["stress-ng", "--cpu", str(a.stress_cpu), "--timeout",
                                       f"{int(seconds) + 60}s", "--quiet"])
        for r in range(a.ranks):
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker",
                                           addr, str(r), str(a.ranks),
                                           str(seconds), str(tmp / f"r{r}.jsonl")]))
        for pr in procs:
            pr.wait(timeout=seconds + 180)
    finally:
        for pr in procs + ([stress] if stress else []):
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    summaries, suspects, generations = [], 0, 0
    for r in range(a.ranks):
        for line in (tmp / f"r{r}.jsonl").read_text().splitlines():
            e = json.loads(line)
            suspects += e["kind"] == "suspect"
            generations += e["kind"] == "generation"
            if e["kind"] == "summary":
                summaries.append(e)
    result = {"ranks": a.ranks, "minutes": a.minutes, "stress_cpu": a.stress_cpu,
              "store": f"etcd, {a.etcd} members" if a.etcd else "TCPStore",
              "false_suspicions": suspects, "generations": generations,
              "max_phi": max((s["max_phi"] for s in summaries), default=None),
              "pings": sum(s["pings_sent"] for s in summaries),
              "acks": sum(s["acks_received"] for s in summaries),
              "ranks_reporting": len(summaries), "logs": str(tmp)}
    print(json.dumps(result))
    return suspects == 0 and generations == 0 and len(summaries) == a.ranks


if __name__ == "__main__":
    sys.exit(main())
