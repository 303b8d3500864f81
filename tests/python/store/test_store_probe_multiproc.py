"""resilient.store.unreachable: whether the job's store answers within a bound, whatever the
store's own timeout (recovery asks it before agreeing; a frozen store host must not cost the
survivors the store's 30 s or the group's 10 min).

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_store_probe.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from resilient.store import unreachable


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while "T (stopped)" not in open(f"/proc/{pid}/status").read():
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_frozen_tcpstore_server_is_unreachable_within_the_bound(free_port: int) -> None:
    """The real case: a TCPStore whose server process is stopped (SIGSTOP; a frozen or cut-off
    host). The client's own timeout is 30 s (and its check() on a stopped server did not return
    within 60 s when tried); the probe answers within its bound of 1 s."""
    server = subprocess.Popen(
        [sys.executable, "-c",
         "import datetime, sys, time, torch.distributed as d\n"
         f"s = d.TCPStore('127.0.0.1', {free_port}, 1, True,"
         " timeout=datetime.timedelta(seconds=60), wait_for_workers=False)\n"
         "print('up', flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", free_port, is_master=False,
                               timeout=timedelta(seconds=30))
        assert unreachable(client, "resilient/probe/1", 1.0) is None
        os.kill(server.pid, signal.SIGSTOP)
        _wait_stopped(server.pid)
        t0 = time.monotonic()
        why = unreachable(client, "resilient/probe/1", 1.0)
        took = time.monotonic() - t0
        assert why == "no answer within 1 s"
        assert took < 5, took
        os.kill(server.pid, signal.SIGCONT)  # the probe left waiting gets its answer
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait(10)
