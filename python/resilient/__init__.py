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
