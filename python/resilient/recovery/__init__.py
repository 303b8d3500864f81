"""In-process recovery: survivors of a rank failure keep training without a restart.

``resilient.recovery.policy``, ``config`` and ``events`` are pure Python; ``Recovery`` (torch,
torch.distributed, the detector and resilient.comm) is imported on first use. See
docs/recovery.md.
"""

from __future__ import annotations

from resilient._lazy import lazy_getattr
from resilient.recovery.config import RecoveryConfig
from resilient.recovery.policy import (
    EXIT_EVICTED,
    STRAGGLER_EXIT_CODE,
    BatchPlan,
    Decision,
    MicroBatch,
    decide,
    exclude_persistent_straggler,
    plan_batch,
    plan_whole_batches,
)
from resilient.recovery.timeline import PHASES, Timeline, phases

_TORCH_NAMES = {"FAULT_POINTS", "PeerFailure", "Recovery", "RecoveryStopped"}


def joining() -> bool:
    """See resilient.recovery.environment.joining."""
    from resilient.recovery.environment import joining as _joining

    return _joining()


__getattr__ = lazy_getattr(__name__, dict.fromkeys(_TORCH_NAMES, "resilient.recovery.core"))


__all__ = [
    "EXIT_EVICTED",
    "FAULT_POINTS",
    "STRAGGLER_EXIT_CODE",
    "exclude_persistent_straggler",
    "PHASES",
    "BatchPlan",
    "Decision",
    "MicroBatch",
    "PeerFailure",
    "Recovery",
    "RecoveryConfig",
    "RecoveryStopped",
    "Timeline",
    "decide",
    "joining",
    "phases",
    "plan_batch",
    "plan_whole_batches",
]
