"""The native NCCL communicator manager (resilient._C.comm) with Python conveniences.

NCCL is loaded at run time with dlopen. In a PyTorch process, load the NCCL that torch ships
(site-packages/nvidia/nccl/lib) so that one NCCL serves both: :func:`load_nccl` looks there first.
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilient import settings
from resilient._C import comm as _comm
from resilient.comm.nccl_env import prepare_nccl_env

CommManager = _comm.CommManager
CommOptions = _comm.CommOptions
InMemoryStore = _comm.InMemoryStore
NcclLibrary = _comm.NcclLibrary
Store = _comm.Store

__all__ = [
    "CommManager",
    "CommOptions",
    "InMemoryStore",
    "NcclLibrary",
    "Store",
    "TorchStoreAdapter",
    "load_nccl",
    "torch_nccl_dir",
]


def torch_nccl_dir() -> str | None:
    """The directory of the NCCL bundled with the installed PyTorch wheels, if any.

    Found without importing torch (looks for the ``nvidia`` namespace package).
    """
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        lib = Path(base) / "nccl" / "lib"
        if (lib / "libnccl.so.2").exists():
            return str(lib)
    return None


def load_nccl(path: str | None = None, *, search_system: bool = True) -> NcclLibrary:
    """Loads NCCL: ``path``, else ``RESILIENT_NCCL_PATH``, else torch's bundled copy, else the
    dynamic loader's search for ``libnccl.so.2``.

    Raises:
        resilient.UnavailableError: NCCL is absent, disabled (``RESILIENT_NCCL=off``) or too old;
            the message lists every location tried.
    """
    prepare_nccl_env()
    chosen = path or settings.get("RESILIENT_NCCL_PATH") or torch_nccl_dir() or ""
    enabled = settings.get("RESILIENT_NCCL")
    return NcclLibrary.load(chosen, search_system, enabled)


class TorchStoreAdapter(Store):
    """Adapts a ``torch.distributed.Store`` (TCPStore, PrefixStore, ...) to the native Store.

    Args:
        store: the torch store; keys are used as given (wrap it in a PrefixStore to namespace).
    """

    def __init__(self, store: Any) -> None:
        super().__init__()
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        """Sets ``key`` to ``value``."""
        self._store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        """Returns ``key``'s value, waiting up to ``timeout_s``; raises TimeoutError."""
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # torch reports a store wait timeout as a RuntimeError
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise TimeoutError(f"store key {key!r}: {exc}") from exc
            raise
        value = self._store.get(key)
        return bytes(value)
