"""resilient: keeps large PyTorch training jobs running through failures."""

from __future__ import annotations

from resilient.errors import (
    CancelledError,
    CorruptCheckpointError,
    ResilientError,
    ResourceExhaustedError,
    UnavailableError,
    VersionMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "CancelledError",
    "CorruptCheckpointError",
    "ResilientError",
    "ResourceExhaustedError",
    "UnavailableError",
    "VersionMismatchError",
    "__version__",
]

# Lazily imported so that `import resilient` (detector agents, the CLI) does not import torch.
_LAZY = {
    "Checkpointer": "resilient.checkpoint",
    "LoadReport": "resilient.checkpoint",
    "SaveHandle": "resilient.checkpoint",
    "FailureDetector": "resilient.detect",
    "StragglerMonitor": "resilient.straggler",
    "Recovery": "resilient.recovery",
    "RecoveryConfig": "resilient.recovery",
    "RecoveryStopped": "resilient.recovery",
    "CheckpointManager": "resilient.training",
    "RNGState": "resilient.training",
    "ResumableSampler": "resilient.training",
    "DistributedCheckpointer": "resilient.distributed",
    "ShardSpec": "resilient.distributed",
}
__all__ += list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
