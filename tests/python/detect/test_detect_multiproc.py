"""Multi-process detector tests on loopback: real ranks (subprocesses), real UDP, a real
torch TCPStore hosted by the test process (outside the ranks, as torchrun's agent would).

One 8-rank cluster is shared by the scenarios, which run in order and each take the next
generation: kill -9 a rank, SIGSTOP a rank, kill rank 0, kill two ranks at once. Each prints its
measured detection time (fault -> every survivor has the verdict) and checks the agreed verdict.
Run as a script with --worker to be one rank.
"""

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

WORLD = 8
HEARTBEAT_S = 0.1


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)  # host:port
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--hang-after", type=int, default=-1, help="stop stepping after this step")
    a = p.parse_args(argv)
    import datetime

    import torch.distributed as dist

    from resilient.detect import FailureDetector

    host, port = a.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), a.world, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    det = FailureDetector(store, a.rank, a.world, job="mp", host=a.host, event_log=a.log,
                          options={"heartbeat_interval_s": HEARTBEAT_S},
                          watchdog_options={"min_step_limit_s": 1.0, "safety_factor": 3.0})
    det.start()
    deadline = time.monotonic() + a.seconds
    step = 0
    next_metrics = 0.0
    while time.monotonic() < deadline:
        if a.hang_after < 0 or step < a.hang_after:
            step += 1
            det.step(step)
        if time.monotonic() >= next_metrics:  # counters for the tests, replaced atomically
            next_metrics = time.monotonic() + 0.2
            tmp = f"{a.log}.metrics.tmp"
            with open(tmp, "w") as f:
                json.dump(det.metrics(), f)
            os.replace(tmp, f"{a.log}.metrics")
        time.sleep(0.02)
    det.stop()
    return 0


class Cluster:
    """N worker processes plus the TCPStore they share; cleans up on close()."""

    def __init__(self, tmp: Path, world: int, hosts: list[str] | None = None,
                 prefixes: list[list[str]] | None = None, store_host: str = "127.0.0.1",
                 extra: dict[int, list[str]] | None = None, store: object = None) -> None:
        import datetime

        import torch.distributed as dist

        self.tmp = tmp
        self.world = world
        self.store = store or dist.TCPStore(store_host, 0, world, is_master=True,
                                            timeout=datetime.timedelta(seconds=30),
                                            wait_for_workers=False)
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ, RESILIENT_LOG_LEVEL="warn")
        for r in range(world):
            cmd = [sys.executable, __file__, "--worker", "--store",
                   f"{store_host}:{self.store.port}", "--rank", str(r), "--world", str(world),
                   "--log", str(self.log(r)), "--host", (hosts or ["127.0.0.1"] * world)[r]]
            cmd += (extra or {}).get(r, [])
            if prefixes:
                cmd = prefixes[r] + cmd
            err = open(tmp / f"rank{r}.err", "w")  # noqa: SIM115
            self.procs.append(subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env))

    def log(self, r: int) -> Path:
        return self.tmp / f"rank{r}.jsonl"

    def events(self, r: int) -> list[dict]:
        try:
            return [json.loads(x) for x in self.log(r).read_text().splitlines() if x.strip()]
        except FileNotFoundError:
            return []

    def metrics(self, r: int) -> dict:
        """Rank r's latest detector counters (written by the worker every 0.2 s)."""
        try:
            return json.loads(Path(f"{self.log(r)}.metrics").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def port(self, r: int) -> int:
        """Rank r's detector UDP port (from its start record)."""
        return next(e["port"] for e in self.events(r) if e["kind"] == "start")

    def wait_started(self, timeout: float = 90) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if all(any(e["kind"] == "start" for e in self.events(r)) for r in range(self.world)):
                return
            for r, p in enumerate(self.procs):
                if p.poll() is not None:
                    err = (self.tmp / f"rank{r}.err").read_text()
                    raise AssertionError(f"rank {r} exited: {err}")
            time.sleep(0.1)
        raise TimeoutError("ranks did not start")

    def wait_verdict(self, survivors: list[int], gone: set[int], t0: float,
                     timeout: float) -> tuple[float, dict]:
        """Waits until every survivor logged a generation without `gone`; returns
        (slowest detection time, {rank: (generation, removed ranks so far)})."""
        end = time.time() + timeout
        while time.time() < end:
            seen = {}
            for r in survivors:
                removed: set[int] = set()
                when, gen = None, None
                for e in self.events(r):
                    if e["kind"] == "generation":
                        removed |= {x["rank"] for x in e["removed"]}
                        if gone <= removed and when is None:
                            when, gen = e["time_wall"], e["generation"]
                if when is not None:
                    seen[r] = (when, gen, frozenset(removed))
            if len(seen) == len(survivors):
                return max(w for w, _, _ in seen.values()) - t0, {
                    r: (g, rm) for r, (_, g, rm) in seen.items()}
            time.sleep(0.05)
        raise AssertionError(f"no verdict on {gone} within {timeout}s; survivors {survivors}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("torch.distributed")
    c = Cluster(tmp_path_factory.mktemp("detect"), WORLD)
    try:
        c.wait_started()
        time.sleep(1.5)  # let the estimators learn the inter-arrival times
        c.alive = set(range(WORLD))
        yield c
    finally:
        c.close()


def _fault(c: Cluster, ranks: list[int], sig: int, bound_s: float, label: str) -> None:
    t0 = time.time()
    for r in ranks:
        os.kill(c.procs[r].pid, sig)
    c.alive -= set(ranks)
    survivors = sorted(c.alive)
    dt, seen = c.wait_verdict(survivors, set(ranks), t0, timeout=10)
    print(f"\n[detect] {label}: all {len(survivors)} survivors agreed in {dt * 1e3:.0f} ms")
    gens = set(seen.values())
    assert len(gens) == 1, f"survivors disagree: {seen}"
    assert dt <= bound_s, f"{label}: {dt:.3f}s > {bound_s}s"
    assert next(iter(gens))[1] & set(survivors) == set()  # no survivor was wrongly removed


def test_kill9_one_rank(cluster):
    # Goal 500 ms; the bound leaves room for a 2-core VM shared with other builds.
    _fault(cluster, [3], signal.SIGKILL, 1.5, "kill -9 rank 3")


def test_sigstop_one_rank(cluster):
    _fault(cluster, [5], signal.SIGSTOP, 3.5, "SIGSTOP rank 5")


def test_kill_rank0(cluster):
    _fault(cluster, [0], signal.SIGKILL, 1.5, "kill -9 rank 0")


def test_kill_two_at_once(cluster):
    _fault(cluster, [1, 6], signal.SIGKILL, 1.5, "kill -9 ranks 1 and 6")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_two_of_three_lost_at_once(tmp_path: Path, sig: int) -> None:
    """With 3 ranks each dead rank's second watcher is the other dead one, so no suspicion is
    ever seconded: the survivor confirms both alone once neither has been heard from for
    max_silence (2.5 s) beyond its suspicion."""
    pytest.importorskip("torch.distributed")
    c = Cluster(tmp_path, 3)
    try:
        c.wait_started()
        time.sleep(1.5)
        t0 = time.time()
        for r in (1, 2):
            os.kill(c.procs[r].pid, sig)
        dt, seen = c.wait_verdict([0], {1, 2}, t0, timeout=20)
        print(f"\n[detect] 2 of 3 ({signal.Signals(sig).name}): rank 0 alone after {dt:.2f} s")
        assert seen[0][1] == {1, 2}
        assert dt <= (8.0 if sig == signal.SIGSTOP else 6.0), dt
    finally:
        c.close()


def test_counters_and_no_false_removals(cluster):
    # Survivors 2, 4, 7 saw no unexpected removal and never dropped a packet of their own job.
    for r in sorted(cluster.alive):
        evs = cluster.events(r)
        removed = {x["rank"] for e in evs if e["kind"] == "generation" for x in e["removed"]}
        assert removed == {0, 1, 3, 5, 6}


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.argv.remove("--worker")
    sys.exit(worker_main(sys.argv[1:]))
