"""Former home of the multi-rank checkpointer, kept as documented aliases: the one
``resilient.Checkpointer`` now serves any world size (docs/STATE.md)."""

from __future__ import annotations

from resilient.checkpoint import (
    CheckpointCommitError,
    Checkpointer,
    SaveHandle,
    ShardSpec,
    default_store,
    read_global,
)

#: Alias of Checkpointer (collective when torch.distributed is initialized).
DistributedCheckpointer = Checkpointer
#: Alias of SaveHandle.
DistSaveHandle = SaveHandle

__all__ = [
    "CheckpointCommitError",
    "DistSaveHandle",
    "DistributedCheckpointer",
    "ShardSpec",
    "default_store",
    "read_global",
]
