"""The replicas' gloo group: its creation waits for every rank only as long as a group's
creation may (a peer lost before it fails it instead of blocking for the group's long operation
timeout), and its operations, point-to-point ones included, then wait the long timeout (a
receiver waits for the next send). Two CPU processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

WORKER = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from resilient.recovery.replica import replica_group
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    if mode == "absent" and rank == 1:
        time.sleep(60)  # alive, but never takes part in the rendezvous (killed by the test)
    t0 = time.monotonic()
    try:
        group = replica_group(timeout_s=3600, rendezvous_s=2)
    except Exception as e:  # noqa: BLE001
        print(f"FAILED after {time.monotonic() - t0:.1f} s: {type(e).__name__}", flush=True)
        sys.exit(3)
    x, y = torch.zeros(4), torch.zeros(2)
    if rank == 1:
        time.sleep(4)  # longer than the rendezvous bound: the operations must still wait
        x += 7
        y += 5
        dist.send(y, dst=0, group=group)  # as the replicas' sender and receiver threads do
    else:
        dist.recv(y, src=1, group=group)
    dist.broadcast(x, src=1, group=group)
    print(f"RECEIVED {x.tolist()} {y.tolist()}", flush=True)
    # Not torch's teardown: with gloo groups, the interpreter's exit sometimes aborts the
    # process ("terminate called without an active exception"): 1 run in 3 with the groups
    # left to Py_Finalize, and still now and then (CI) after destroy_process_group(). What
    # this test checks ended above.
    os._exit(0)
""")


def _start(mode: str) -> tuple[dist.TCPStore, list[subprocess.Popen]]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(store.port), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for r in range(2)]
    return store, procs


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.timeout(120)
def test_a_peer_missing_from_the_rendezvous_fails_it_within_the_bound() -> None:
    store, procs = _start("absent")
    try:
        t0 = time.monotonic()
        out, _ = procs[0].communicate(timeout=40)
        took = time.monotonic() - t0
    finally:
        _kill(procs)
    assert procs[0].returncode == 3, out[-3000:]
    assert "FAILED after" in out, out[-3000:]
    assert took < 30, (took, out[-3000:])  # not the operation timeout (an hour)


@pytest.mark.timeout(120)
def test_its_operations_wait_longer_than_the_rendezvous_bound() -> None:
    store, procs = _start("both")
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        _kill(procs)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        assert "RECEIVED [7.0, 7.0, 7.0, 7.0] [5.0, 5.0]" in out, out[-3000:]
