"""resilient.store.unreachable: whether the job's store answers within a bound, whatever the
store's own timeout (recovery asks it before agreeing; a frozen store host must not cost the
survivors the store's 30 s or the group's 10 min)."""


from __future__ import annotations

import threading
import time

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
