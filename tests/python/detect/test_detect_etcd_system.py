"""The failure detector on the native etcd store: 4 ranks (subprocesses) each open
``connect_store("etcd://...")`` (resilient._C.EtcdStore: the agent's store calls go to etcd from
C++, without the GIL) on a real 3-member etcd cluster started here; a rank is killed with -9 and
every survivor must log the same generation without it. Then the etcd leader is killed and a second
rank too: the survivors agree again through the remaining two members. Run as a script with
--worker to be one rank."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from etcd_cluster import EtcdCluster

WORLD = 4


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)  # etcd://...
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--seconds", type=float, default=60)
    a = p.parse_args(argv)
    from resilient.detect import FailureDetector
    from resilient.store import connect_store

    store = connect_store(a.store)
    det = FailureDetector(store, a.rank, WORLD, job="etcd", host="127.0.0.1", event_log=a.log,
                          options={"heartbeat_interval_s": 0.1})
    det.start()
    deadline = time.monotonic() + a.seconds
    step = 0
    while time.monotonic() < deadline:
        step += 1
        det.step(step)
        time.sleep(0.02)
    det.stop()
    return 0


def events(log: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def removed_by(log: Path) -> dict[int, frozenset]:
    """{generation: ranks removed so far} from a rank's event log."""
    out, removed = {}, set()
    for e in events(log):
        if e["kind"] == "generation":
            removed |= {x["rank"] for x in e["removed"]}
            out[e["generation"]] = frozenset(removed)
    return out


def wait_agreed(logs: list[Path], survivors: list[int], gone: set[int], timeout: float) -> int:
    """The generation every survivor reached that removes exactly `gone` so far."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        firsts = set()
        for r in survivors:
            gens = [g for g, rm in sorted(removed_by(logs[r]).items()) if gone <= rm]
            if not gens:
                break
            firsts.add((gens[0], removed_by(logs[r])[gens[0]]))
        else:
            assert len(firsts) == 1, f"survivors disagree: {firsts}"
            gen, rm = next(iter(firsts))
            assert rm == frozenset(gone), f"generation {gen} removed {set(rm)}, not {gone}"
            return gen
        time.sleep(0.05)
    raise AssertionError(f"no agreed verdict on {gone} within {timeout} s; survivors {survivors}")


def test_detector_agrees_through_etcd_when_a_rank_and_the_etcd_leader_die(tmp_path):
    with EtcdCluster(tmp_path, 3) as etcd:
        url = "etcd://" + ",".join(etcd.endpoints) + "/detect-test/"
        logs = [tmp_path / f"rank{r}.jsonl" for r in range(WORLD)]
        env = dict(os.environ, RESILIENT_LOG_LEVEL="warn")  # the run id is agreed through etcd
        env.pop("RESILIENT_DETECT_RUN_ID", None)
        env.pop("TORCHELASTIC_RUN_ID", None)
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--store", url,
                                   "--rank", str(r), "--log", str(logs[r])],
                                  stdout=open(tmp_path / f"rank{r}.err", "w"),  # noqa: SIM115
                                  stderr=subprocess.STDOUT, env=env)
                 for r in range(WORLD)]
        try:
            end = time.monotonic() + 45
            while not all(any(e["kind"] == "start" for e in events(lg)) for lg in logs):
                for r, p in enumerate(procs):
                    if p.poll() is not None:
                        raise AssertionError(f"rank {r}: {(tmp_path / f'rank{r}.err').read_text()}")
                assert time.monotonic() < end, "ranks did not start"
                time.sleep(0.1)
            time.sleep(1.0)  # the estimators learn the inter-arrival times

            procs[3].send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            gen = wait_agreed(logs, [0, 1, 2], {3}, timeout=15)
            print(f"\n[detect/etcd] kill -9 rank 3: generation {gen} agreed in "
                  f"{time.monotonic() - t0:.2f} s")

            etcd.kill(etcd.leader())
            procs[2].send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            gen2 = wait_agreed(logs, [0, 1], {2, 3}, timeout=20)
            assert gen2 > gen
            print(f"[detect/etcd] etcd leader and rank 2 killed: generation {gen2} agreed in "
                  f"{time.monotonic() - t0:.2f} s")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.argv.remove("--worker")
    sys.exit(worker_main(sys.argv[1:]))
elif __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
