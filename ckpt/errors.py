"""Exceptions raised by the checkpoint store.

User-facing problems subclass the built-in families (``ValueError``, ``FileNotFoundError``,
``RuntimeError``) so callers can catch them either way. Every message names the file, key or
field at fault and says what to do about it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "CheckpointNotFoundError",
    "FormatVersionError",
    "StateMismatchError",
    "LeaseHeldError",
    "LeaseLostError",
    "StorageUnavailableError",
    "RankFailuresError",
]


class CheckpointError(Exception):
    """Base class of every error raised by ``ckpt``."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint's manifest or data does not match what was committed.

    ``path`` names the file (or key) at fault; ``expected``/``actual`` carry the checksum or
    size that disagreed, when that is the cause.
    """

    def __init__(self, message: str, *, path: str | None = None, expected=None, actual=None):
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.actual = actual


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class FormatVersionError(CorruptCheckpointError):
    """The manifest was written in a format this version cannot read."""


class StateMismatchError(CheckpointError, ValueError):
    """The state to load into does not match the checkpoint.

    Lists every problem at once: ``missing`` (in the state, not in the checkpoint),
    ``unexpected`` (in the checkpoint, asked for by no rank) and ``mismatched`` (shape or
    dtype).
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class LeaseHeldError(CheckpointError, RuntimeError):
    """Another live job holds the write lease on this checkpoint root."""


class StorageUnavailableError(CheckpointError, OSError):
    """The storage backend cannot be reached or refuses our credentials."""


class RankFailuresError(CheckpointError, RuntimeError):
    """One or more ranks failed a collective checkpoint operation.

    ``failures`` maps rank to the error text that rank reported, so a 64-rank failure reads
    as one error.
    """

    def __init__(self, what: str, failures: dict[int, str]):
        self.failures = dict(failures)
        lines = [f"{what} failed on {len(failures)} rank(s):"]
        for rank in sorted(failures):
            lines.append(f"  rank {rank}: {failures[rank]}")
        super().__init__("\n".join(lines))


class LeaseLostError(CheckpointError, RuntimeError):
    """This writer's lease was taken over: it is fenced off and its commit does not count."""
