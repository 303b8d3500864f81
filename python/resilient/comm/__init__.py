"""Communicators that survive failures: the native NCCL manager (non-blocking init and
collectives, revoke/abort, shrink or fresh init per generation) and helpers that rebuild
torch.distributed process groups and DDP for a new membership.

``resilient.comm.native`` needs only the native core; ``resilient.comm.process_group`` imports
torch (loaded on first use of its names here).
"""

from __future__ import annotations

from resilient._lazy import lazy_getattr
from resilient.comm.native import (
    CommManager,
    CommOptions,
    InMemoryStore,
    NcclLibrary,
    Store,
    load_nccl,
    torch_nccl_dir,
)

# What resilient.comm.process_group defines (it imports torch: loaded on first use).
TORCH_NAMES = frozenset({
    "RebuildResult",
    "RebuildTimings",
    "abort_groups",
    "abort_process_group",
    "backend_of",
    "generation_store",
    "gloo_lazy_init",
    "join_process_group",
    "name_default_group_ranks",
    "nccl_groups",
    "rebuild_process_group",
    "release_retired_groups",
    "retire_groups",
    "revoke_groups",
    "rewrap_ddp",
    "start_aborts",
    "supports_shrink",
    "survivor_rank",
    "verify_group",
    "wait_for_aborts",
    "with_nccl_groups",
})


__getattr__ = lazy_getattr(__name__, dict.fromkeys(TORCH_NAMES, "resilient.comm.process_group"))


__all__ = [  # the torch names resolve through __getattr__
    "CommManager",
    "CommOptions",
    "InMemoryStore",
    "NcclLibrary",
    "Store",
    "load_nccl",
    "torch_nccl_dir",
    *sorted(TORCH_NAMES),
]
