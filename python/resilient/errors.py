"""Exceptions raised by resilient. The native core maps its error codes to these in one place
(bindings/errors.cpp); deadlines raise the built-in TimeoutError and I/O failures OSError."""

from __future__ import annotations


class ResilientError(RuntimeError):
    """Base class for resilient's own errors."""


class CorruptCheckpointError(ResilientError):
    """A checkpoint failed verification: bad checksum, truncated or malformed file.

    Attributes:
        path: the file that failed, when known.
        offset: the byte offset in that file, when known.
    """

    def __init__(self, message: str, path: str | None = None, offset: int | None = None):
        super().__init__(message)
        self.path = path
        self.offset = offset


class CheckpointNotFoundError(ResilientError, FileNotFoundError):
    """There is no checkpoint where one was asked for: the root does not exist, is not a
    resilient checkpoint root (a step directory, a DCP or torch.save directory), or holds no
    such step."""

    def __init__(self, message: str, path: str | None = None):
        RuntimeError.__init__(self, message)
        self.path = path
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class IncompatibleCheckpointError(ResilientError, ValueError):
    """The checkpoint is intact but does not fit: the target state has keys the checkpoint
    lacks (``missing``), the checkpoint has keys the target lacks (``unexpected``), or a value
    differs in kind, dtype or shape (``mismatched``, "key: why"); also a world size or per-rank
    state that a strict load rejects. Nothing in the target was modified."""

    def __init__(
        self,
        message: str,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        mismatched: list[str] | None = None,
    ):
        super().__init__(message)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.mismatched = list(mismatched or [])


class VersionMismatchError(IncompatibleCheckpointError):
    """A checkpoint written in a format version this build cannot read."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class CollectiveError(ResilientError):
    """A collective call (a save or load of a multi-rank checkpointer) that not every rank
    entered in time, or entered with different arguments (steps)."""


class ReplicaMismatchError(ResilientError, ValueError):
    """Replicated state (what every data-parallel rank must hold identically) differs between
    ranks at a save; per-rank values (RNG state, running statistics) belong in ``rank_state``."""


class CheckpointCommitError(ResilientError):
    """A save was not committed: a rank failed, or did not report in time. Raised, the same on
    every rank, by the save's ``handle.wait()`` and by the next ``save()``, ``wait()`` or
    ``close()``. Its type also says the cause, in every mode: an I/O error is a
    :class:`CheckpointIOError`, an ``OSError`` with the failing rank's errno (a full disk is
    ``ENOSPC`` with one process or many), a deadline a :class:`CheckpointTimeoutError`, a
    ``TimeoutError``. On the rank where it happened it is chained to the original error
    (``__cause__``)."""


class CheckpointIOError(CheckpointCommitError, OSError):
    """A save not committed because of an I/O error (``errno``: ENOSPC, EIO, EDQUOT...)."""

    def __init__(self, errno: int, message: str, filename: str | None = None):
        RuntimeError.__init__(self, message)
        self.errno = errno
        self.strerror = message
        self.filename = filename

    def __str__(self) -> str:
        where = f": {self.filename!r}" if self.filename else ""
        return f"[Errno {self.errno}] {self.strerror}{where}"

    def __reduce__(self) -> tuple:
        return (type(self), (self.errno, self.strerror, self.filename))


class CheckpointTimeoutError(CheckpointCommitError, TimeoutError):
    """A save not committed because a rank or a step of the commit ran out of time."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def commit_error(message: str, errno: int | None = None, timeout: bool = False,
                 filename: str | None = None) -> CheckpointCommitError:
    """The CheckpointCommitError for a cause: with an errno a CheckpointIOError, for a deadline
    a CheckpointTimeoutError, otherwise the plain class."""
    if errno:
        return CheckpointIOError(errno, message, filename)
    if timeout:
        return CheckpointTimeoutError(message)
    return CheckpointCommitError(message)


class UnavailableError(ResilientError):
    """A peer or platform feature (CUDA, NCCL, io_uring) is absent or gone."""


class CancelledError(ResilientError):
    """The operation was cancelled (for example by close())."""


class ResourceExhaustedError(ResilientError):
    """A configured budget (host memory pool, queue) cannot satisfy the request."""


class RootInUseError(ResilientError):
    """Another writer (another process, or another Checkpointer in this one) is saving to the
    same checkpoint root: one writer per root."""


# Recovery's own (resilient.recovery raises and catches them; re-exported there).


class PeerFailure(ResilientError):
    """A collective could not complete because a peer failed. ``cause``: collective_error
    (the collective raised), verdict (the detector removed a member), timeout (it ran past
    RecoveryConfig.collective_timeout_s) or evicted (this rank was removed)."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(f"peer failure ({cause}){': ' + detail if detail else ''}")
        self.cause = cause


class RecoveryStopped(ResilientError):
    """Training cannot continue (too few ranks, evicted, too many recoveries). ``exit_code``
    is what a launcher-facing script should exit with."""

    exit_code = 3


class GateAbandoned(ResilientError):
    """The generation's gate was abandoned: a newer generation (or a timeout) came first."""


class ReplicaUnavailable(ResilientError):
    """No step of the lost state is complete and verified in memory: load from storage."""
