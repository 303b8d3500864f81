"""Checkpoints: one Checkpointer for one process or every rank of a job (docs/STATE.md).

    ckpt = Checkpointer("/ckpt/run42", keep=3, create=True)
    start = ckpt.load({"model": model, "optim": opt}) or 0   # None: a fresh run
    ...
    ckpt.save(step, {"model": model, "optim": opt})          # returns while it is written
    ckpt.close()

Modules: codec (state <-> JSON document + tensors, no pickle), contract (matching a saved
state against the live one), plan (which rank writes and reads which piece), reader, root
(the directory, lineage, retention), ranks (the collectives), checkpointer.
"""

from __future__ import annotations

from resilient import _follow_store_setting
from resilient.checkpoint.checkpointer import (
    CheckpointCommitError,
    Checkpointer,
    LoadReport,
    SaveHandle,
    tensor_descriptor,
)
from resilient.checkpoint.plan import ShardSpec
from resilient.checkpoint.ranks import default_store


def read_global(root: str, step: int | None = None) -> dict:
    """This process alone: the tensors of `step` (default: newest of the lineage) assembled to
    their global shapes by logical name; per-rank tensors as "R<rank>/<name>"."""
    with Checkpointer(root, keep=0, distributed=False, tiers=[]) as ck:
        return ck.read_global(step)


_follow_store_setting()  # RESILIENT_STORE=etcd:// (torch is imported now)

__all__ = [
    "CheckpointCommitError",
    "Checkpointer",
    "LoadReport",
    "SaveHandle",
    "ShardSpec",
    "default_store",
    "read_global",
    "tensor_descriptor",
]
