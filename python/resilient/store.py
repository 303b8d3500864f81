"""The job's key/value store, as the native core sees it.

One native interface (``resilient._C.Store``; contract in cpp/include/resilient/common/store.hpp)
serves the failure detector's membership records and the communicator manager's NCCL unique ids.
Anything in resilient that takes a store takes either a native store (:class:`InMemoryStore`) or
any object with the ``torch.distributed.Store`` methods of :class:`StoreLike` (TCPStore,
PrefixStore, HashStore): one native adapter calls those methods, mapping ``TimeoutError`` and
torch's ``DistStoreError`` to a timeout, ``KeyError`` to an absent key and any other exception to
an unavailable store. :func:`as_store` returns that native view of a store (for tests and tools).
:func:`unreachable` asks whether a store answers within a bound, whatever its own timeout.

:func:`connect_store` opens a native store by URL: ``etcd://h1:2379,h2:2379/<run prefix>/`` is
an :class:`EtcdStore` (the native client of an etcd v3 cluster; docs/store.md), ``memory://`` an
:class:`InMemoryStore`. A native store also has ``torch.distributed.Store``'s ``check`` and
``wait``, so the detector and recovery take it as they take a TCPStore.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from resilient._C import InMemoryStore, Store, as_store

try:
    from resilient._C import EtcdStore, connect_store
except ImportError:  # built with -DRESILIENT_ETCD=OFF (no libcurl headers: scripts/gpu_run.sh)
    EtcdStore = None  # type: ignore[assignment,misc]

    def connect_store(url: str) -> Store:  # type: ignore[misc]
        """Unavailable: this build has no native etcd client."""
        raise RuntimeError(f"connect_store({url!r}): this build of resilient has no native etcd "
                           "client (configured with RESILIENT_ETCD=OFF); rebuild with libcurl "
                           "(scripts/setup.sh), or use resilient.etcd.EtcdStore")

__all__ = ["EtcdStore", "InMemoryStore", "Store", "StoreLike", "as_store", "connect_store",
           "unreachable"]


def unreachable(store: Any, key: str, within_s: float = 5.0) -> str | None:
    """Why `store` did not answer a read of `key` within `within_s` seconds; None when it
    answered (the key being absent is an answer). The read runs on a daemon thread: on a server
    that is frozen or cut off, a torch store waits out its own timeout (30 s for a TCPStore by
    default, the group's under init_process_group) or longer (a TCPStore's check() on a stopped
    server did not return within 60 s at a 5 s timeout), and only the caller's bound may
    count. A thread left waiting ends when the store answers or fails. A store that bounds its
    own requests (resilient.etcd.EtcdStore's ``probe``) is asked on the caller's thread: a
    thread that returns into Python while the interpreter exits can crash it."""
    base = store
    while hasattr(base, "underlying_store"):  # torch PrefixStores
        base = base.underlying_store
    if hasattr(base, "probe"):
        return base.probe(within_s)
    native = as_store(store)
    answer: list[str | None] = []

    def probe() -> None:
        try:
            native.get(key, within_s, wait=False)
            answer.append(None)
        except KeyError:
            answer.append(None)
        except Exception as e:  # noqa: BLE001 -- any failure to answer is the answer
            text = str(e).splitlines()[0][:200] if str(e) else ""
            answer.append(f"{type(e).__name__}: {text}")

    t = threading.Thread(target=probe, name="resilient-store-probe", daemon=True)
    t.start()
    t.join(within_s)
    return answer[0] if answer else f"no answer within {within_s:g} s"


class StoreLike(Protocol):
    """The subset of ``torch.distributed.Store`` that resilient calls."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...
    def check(self, keys: list) -> bool: ...
    def wait(self, keys: list, timeout: Any = ...) -> None: ...
