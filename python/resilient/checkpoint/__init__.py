"""Checkpoints: one Checkpointer for one process or every rank of a job (docs/STATE.md).

    ckpt = Checkpointer("/ckpt/run42", keep=3, create=True)
    step = ckpt.load({"model": model, "optim": opt}) or 0    # steps done; None: a fresh run
    ...                                                      # train one step, then
    step += 1
    ckpt.save(step, {"model": model, "optim": opt})          # returns while it is written
    ckpt.close()

Modules: codec (state <-> JSON document + tensors, no pickle), contract (matching a saved
state against the live one), plan (which rank writes and reads which piece), reader, root
(the directory, lineage, retention), ranks (the collectives), checkpointer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resilient import _follow_store_setting
from resilient._lazy import lazy_getattr
from resilient.checkpoint.plan import ShardSpec

# The torch side is imported on first use, so that the modules that only read a root's files
# (catalog, verify, root, tiers: `resilient ckpt ls`) are imported without torch (seconds).
_LAZY = {
    "CheckpointCommitError": "resilient.checkpoint.checkpointer",
    "Checkpointer": "resilient.checkpoint.checkpointer",
    "LoadReport": "resilient.checkpoint.checkpointer",
    "SaveHandle": "resilient.checkpoint.checkpointer",
    "tensor_descriptor": "resilient.checkpoint.checkpointer",
    "default_store": "resilient.checkpoint.ranks",
}

if TYPE_CHECKING:
    from resilient.checkpoint.checkpointer import (
        CheckpointCommitError,
        Checkpointer,
        LoadReport,
        SaveHandle,
        tensor_descriptor,
    )
    from resilient.checkpoint.ranks import default_store


__getattr__ = lazy_getattr(__name__, _LAZY)


def read_global(root: str, step: int | None = None) -> dict:
    """This process alone: the tensors of `step` (default: newest of the lineage) assembled to
    their global shapes by logical name; per-rank tensors as "R<rank>/<name>"."""
    from resilient.checkpoint.checkpointer import Checkpointer

    with Checkpointer(root, keep=0, distributed=False, tiers=[]) as ck:
        return ck.read_global(step)


_follow_store_setting()  # RESILIENT_STORE=etcd:// when torch is imported (checkpointer.py: too)

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
