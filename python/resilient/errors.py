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


class VersionMismatchError(ResilientError):
    """A checkpoint written in a format version this build cannot read."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class UnavailableError(ResilientError):
    """A peer or platform feature (CUDA, NCCL, io_uring) is absent or gone."""


class CancelledError(ResilientError):
    """The operation was cancelled (for example by close())."""


class ResourceExhaustedError(ResilientError):
    """A configured budget (host memory pool, queue) cannot satisfy the request."""
