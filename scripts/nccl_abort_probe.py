"""How long ending a stuck NCCL collective takes, by method (2 GPUs; benchmarks/RESULTS.md).

    python scripts/nccl_abort_probe.py --method abort|revoke|revoke_abort|groups

Rank 1 stops taking part after a warm-up (it sleeps, alive); rank 0's training thread keeps
issuing all-reduces, as FSDP2's prefetching does, while another thread ends the communicator
0.3 s later with `--method`. Printed (rank 0, seconds after that start): when the method's call
returned, when the training thread saw an error, and how long destroy_process_group took
(revoke_abort: the training thread aborts after the revoke, as a rebuild does, and that abort is
timed too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def rank_main(rank: int, method: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    x = torch.ones(1 << 20, device=dev)
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        time.sleep(6)
        os._exit(0)
    pg = dist.group.WORLD
    out: dict = {"method": method}
    t0 = [0.0]

    def end() -> None:
        time.sleep(0.3)
        t0[0] = time.monotonic()
        try:
            if method == "groups":  # resilient's own path (revoke_groups), reasons logged
                import logging

                from resilient.comm.process_group import _find_torch_nccl, revoke_groups

                logging.basicConfig(level=logging.INFO)
                out["torch_nccl"] = repr(_find_torch_nccl())
                out["revoked"] = revoke_groups([pg])
                out["revoke_s"] = time.monotonic() - t0[0]
            if method in ("revoke", "revoke_abort"):
                from resilient.comm import load_nccl

                lib = load_nccl()
                ptr = pg._get_backend(dev)._comm_ptr()
                lib.revoke_comm(ptr)
                out["revoke_s"] = time.monotonic() - t0[0]
            if method == "abort":
                pg.abort()
                out["abort_s"] = time.monotonic() - t0[0]
        except Exception as e:  # noqa: BLE001
            out["end_error"] = repr(e)[:300]

    threading.Thread(target=end, daemon=True).start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            w = dist.all_reduce(x, async_op=True)
            time.sleep(0.01)
            if w.is_completed():
                w.wait()
        out["error"] = "none within 5 s"
    except Exception as e:  # noqa: BLE001
        out["observed_s"] = time.monotonic() - t0[0]
        out["error"] = repr(e)[:200]
    if method == "revoke_abort":  # what a rebuild does next on the training thread
        time.sleep(0.05)
        t1 = time.monotonic()
        pg.abort()
        out["abort_after_revoke_s"] = time.monotonic() - t1
    t1 = time.monotonic()
    try:
        dist.destroy_process_group()
        out["destroy_s"] = time.monotonic() - t1
    except Exception as e:  # noqa: BLE001
        out["destroy_error"] = repr(e)[:200]
    print(json.dumps(out), flush=True)
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="abort", choices=("abort", "revoke", "revoke_abort",
                                                           "groups"))
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("--rank", type=int, default=-1)
    a = ap.parse_args()
    if a.rank >= 0:
        rank_main(a.rank, a.method, a.port)
        return 0
    import subprocess

    procs = [subprocess.Popen([sys.executable, __file__, "--method", a.method, "--port",
                               str(a.port), "--rank", str(r)]) for r in (0, 1)]
    codes = [p.wait(timeout=60) for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
