"""resilient.store.unreachable: whether the job's store answers within a bound, whatever the
store's own timeout (recovery asks it before agreeing; a frozen store host must not cost the
survivors the store's 30 s or the group's 10 min)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from resilient.store import InMemoryStore, unreachable


class _Store:
    """torch.distributed.Store's methods, each doing `act()` first."""

    def __init__(self, act):
        self.act = act

    def set(self, key, value):
        self.act()

    def get(self, key):
        self.act()
        return b""

    def compare_set(self, key, expected, desired):
        self.act()
        return desired

    def check(self, keys):
        self.act()
        return False

    def wait(self, keys, timeout=None):
        self.act()


def test_a_store_that_answers_is_reachable() -> None:
    assert unreachable(InMemoryStore(), "resilient/probe/0", 1.0) is None
    assert unreachable(_Store(lambda: None), "resilient/probe/0", 1.0) is None


def test_a_store_that_fails_says_why() -> None:
    def refuse():
        raise ConnectionResetError("peer reset")

    why = unreachable(_Store(refuse), "resilient/probe/0", 1.0)
    assert why is not None and "peer reset" in why


def test_a_store_that_hangs_is_unreachable_after_the_bound() -> None:
    release = threading.Event()
    try:
        t0 = time.monotonic()
        why = unreachable(_Store(lambda: release.wait(30)), "resilient/probe/0", 0.3)
        took = time.monotonic() - t0
        assert why == "no answer within 0.3 s"
        assert 0.3 <= took < 3
    finally:
        release.set()


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
