"""resilient: keeps large PyTorch training jobs running through failures."""

from __future__ import annotations

from resilient.errors import (
    CancelledError,
    CheckpointCommitError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CollectiveError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ReplicaMismatchError,
    ResilientError,
    ResourceExhaustedError,
    RootInUseError,
    UnavailableError,
    VersionMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "CancelledError",
    "CheckpointCommitError",
    "CheckpointIOError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "CollectiveError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "ReplicaMismatchError",
    "ResilientError",
    "ResourceExhaustedError",
    "RootInUseError",
    "UnavailableError",
    "VersionMismatchError",
    "__version__",
]

def _follow_store_setting() -> None:
    """With RESILIENT_STORE=etcd://... (``resilient run --store``) the job's default process
    group rendezvouses on etcd, also for ``init_process_group()`` with torch's default env://.
    Done here once torch is imported (a training script), and again by resilient's torch-side
    packages (checkpoint, recovery), so ``import resilient`` alone (detector agents, the CLI)
    still does not import torch."""
    import os
    import sys

    if "torch" in sys.modules and os.environ.get("RESILIENT_STORE", "").startswith(
            ("etcd://", "etcds://")):
        from resilient.etcd import install_env_rendezvous

        install_env_rendezvous()


_follow_store_setting()

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
    "joining": "resilient.recovery",
    "CheckpointManager": "resilient.checkpoint.manager",
    "FileTier": "resilient.checkpoint.tiers",
    "S3Tier": "resilient.checkpoint.s3",
    "RNGState": "resilient.checkpoint.manager",
    "ResumableSampler": "resilient.checkpoint.sampler",
    "forever": "resilient.checkpoint.manager",
    "DistributedCheckpointer": "resilient.distributed",
    "ShardSpec": "resilient.checkpoint",
}
__all__ += list(_LAZY)
__all__ += ["install_crash_handler", "settings"]


def install_crash_handler() -> None:
    """On a fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) writes the signal, the
    crashing thread's id and name (an NCCL proxy, torch's watchdog, a resilient writer...) and its
    native stack to stderr, then hands the signal on unchanged (to faulthandler, which adds the
    Python stacks, or to the default action). ``RESILIENT_CRASH_HANDLER=1`` installs it on import.
    """
    from resilient import _C

    _C.install_crash_handler()


def _dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 writes every Python thread's stack to stderr (faulthandler), unless the program
    handles SIGUSR1 itself: how a launcher asks a hung rank where it is before killing it."""
    import faulthandler
    import signal
    import sys

    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


from resilient import settings  # noqa: E402

if settings.get("RESILIENT_CRASH_HANDLER"):
    install_crash_handler()
    _dump_stacks_on_sigusr1()


from resilient._lazy import lazy_getattr  # noqa: E402

__getattr__ = lazy_getattr(__name__, _LAZY)
