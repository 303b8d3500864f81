"""Sharded, fully parallel checkpoints for torch.distributed jobs (DDP, Megatron-style TP x DP)."""

from __future__ import annotations

from resilient.distributed.checkpointer import (
    CheckpointCommitError,
    DistributedCheckpointer,
    DistSaveHandle,
    default_store,
)
from resilient.distributed.plan import ShardSpec
from resilient.distributed.restore import read_global

__all__ = [
    "CheckpointCommitError",
    "DistSaveHandle",
    "DistributedCheckpointer",
    "ShardSpec",
    "default_store",
    "read_global",
]
