"""The job's key/value store, as the native core sees it.

One native interface (``resilient._C.Store``; contract in cpp/include/resilient/common/store.hpp)
serves the failure detector's membership records and the communicator manager's NCCL unique ids.
Anything in resilient that takes a store takes either a native store (:class:`InMemoryStore`) or
any object with the ``torch.distributed.Store`` methods of :class:`StoreLike` (TCPStore,
PrefixStore, HashStore): one native adapter calls those methods, mapping ``TimeoutError`` and
torch's ``DistStoreError`` to a timeout, ``KeyError`` to an absent key and any other exception to
an unavailable store. :func:`as_store` returns that native view of a store (for tests and tools).
"""

from __future__ import annotations

from typing import Any, Protocol

from resilient._C import InMemoryStore, Store, as_store

__all__ = ["InMemoryStore", "Store", "StoreLike", "as_store"]


class StoreLike(Protocol):
    """The subset of ``torch.distributed.Store`` that resilient calls."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...
    def check(self, keys: list) -> bool: ...
    def wait(self, keys: list, timeout: Any = ...) -> None: ...
