"""The native NCCL communicator manager (resilient._C.comm) with Python conveniences.

NCCL is loaded at run time with dlopen. In a PyTorch process, load the NCCL that torch ships
(site-packages/nvidia/nccl/lib) so that one NCCL serves both: :func:`load_nccl` looks there first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from resilient import settings
from resilient._C import comm as _comm
from resilient.comm.nccl_env import prepare_nccl_env
from resilient.store import InMemoryStore, Store

CommManager = _comm.CommManager
CommOptions = _comm.CommOptions
NcclLibrary = _comm.NcclLibrary

__all__ = [
    "CommManager",
    "CommOptions",
    "InMemoryStore",
    "NcclLibrary",
    "Store",
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
