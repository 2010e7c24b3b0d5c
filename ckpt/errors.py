"""Exceptions raised by the checkpoint store, and how a command reports one: one line.

User-facing problems subclass the built-in families (``ValueError``, ``FileNotFoundError``,
``RuntimeError``) so callers can catch them either way. Every message names the file, key or
field at fault and says what to do about it. :func:`error_line` turns an exception into the
one line the ``ckpt`` command and ``python -m trainer`` print; :class:`OneLineArgumentParser`
makes argparse's usage errors read the same way (exit status 2).
"""

from __future__ import annotations

import argparse

__all__ = [
    "error_line",
    "OneLineArgumentParser",
    "CheckpointError",
    "CorruptCheckpointError",
    "AllCheckpointsDamagedError",
    "CheckpointNotFoundError",
    "FormatVersionError",
    "StateMismatchError",
    "PartialCheckpointError",
    "LeaseHeldError",
    "LeaseLostError",
    "StorageUnavailableError",
    "RankFailuresError",
    "FencedCheckpointError",
    "AbandonedCheckpointError",
    "SaveAbandoned",
    "missing_file_error",
    "size_mismatch_error",
    "crc_mismatch_error",
]


def error_line(exc: BaseException, explained: tuple[type, ...] = ()) -> str:
    """``exc`` as one line. Errors that explain themselves (the project's and the types in
    ``explained``, e.g. a command's usage error) read as their message; anything else is
    named by its type, with a pointer to --debug."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    for ln in lines[1:]:  # a per-rank list ("... failed on 2 rank(s):" then one per rank)
        text += (" " if text.endswith(":") else "; ") + ln
    if isinstance(exc, (CheckpointError, *explained)):
        return text
    return f"{type(exc).__name__}: {text or 'no message'} (run with --debug for the traceback)"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (exit status 2), like every other error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


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


class AllCheckpointsDamagedError(CorruptCheckpointError):
    """A root holds committed checkpoints, and every one of them failed to load.

    Raised by ``load_latest(..., raise_if_all_damaged=True)`` to tell "everything is
    damaged" from "nothing there" (which returns None). ``failures`` lists
    ``(step, reason)`` newest first; the message is one line. The state loaded into is
    unchanged.
    """

    def __init__(self, root: str, failures: list[tuple[int, str]], *,
                 fix: str = "Repair or remove the damaged checkpoints, or load into a fresh "
                            "state on purpose."):
        self.root = root
        self.failures = [(int(s), " ".join(str(r).split())) for s, r in failures]
        self.fix = fix
        found = "; ".join(f"step {s}: {r}" for s, r in self.failures)
        super().__init__(f"every checkpoint under {root} is damaged, none was loaded "
                         f"({found}). {fix}", path=root)

    def __reduce__(self):
        return _rebuild_all_damaged, (self.root, self.failures, self.fix)


def _rebuild_all_damaged(root, failures, fix):
    return AllCheckpointsDamagedError(root, failures, fix=fix)


# The three ways a file a manifest lists can be damaged, worded once for every reader.
def missing_file_error(where: str, context: str = "") -> CorruptCheckpointError:
    """The file ``where`` (as ``Storage.describe`` names it) that a manifest lists is absent.
    ``context`` starts the message (e.g. ``"attachment 'config.json': "``)."""
    return CorruptCheckpointError(
        f"{context}data file {where} is missing; the checkpoint is incomplete. Load an "
        f"earlier step.", path=where)


def size_mismatch_error(where: str, expected: int, actual: int,
                        context: str = "") -> CorruptCheckpointError:
    """The file ``where`` holds ``actual`` bytes where its manifest says ``expected``."""
    return CorruptCheckpointError(
        f"{context}data file {where} is {actual} bytes, the manifest says {expected} "
        f"(truncated or overwritten). Load an earlier step.", path=where,
        expected=expected, actual=actual)


def crc_mismatch_error(where: str, expected: int, actual: int, *,
                       span: tuple[int, int] | None = None,
                       context: str = "") -> CorruptCheckpointError:
    """The crc32c of ``where`` (of its bytes ``[start, end)`` when ``span``) is ``actual``,
    not the manifest's ``expected``."""
    part = "" if span is None else f" bytes [{span[0]}, {span[1]})"
    return CorruptCheckpointError(
        f"{context}checksum mismatch in {where}{part}: expected crc32c {expected:08x}, got "
        f"{actual:08x}. The file is corrupt; load an earlier step.", path=where,
        expected=f"{expected:08x}", actual=f"{actual:08x}")


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


class PartialCheckpointError(CheckpointError, ValueError):
    """A version that holds one node's share of a job-wide checkpoint (its manifest's
    ``span``: a node-local checkpoint of a job whose tensors are sharded across nodes) was
    asked for what only a whole checkpoint can give: a load on another layout, a load that
    needs chunks other nodes hold, an export. Not damage: an older version of that root
    would not fare better; the durable root holds whole checkpoints."""


class LeaseHeldError(CheckpointError, RuntimeError):
    """Another live job holds the write lease on this checkpoint root."""


class StorageUnavailableError(CheckpointError, OSError):
    """The storage backend cannot be reached or refuses our credentials."""


class RankFailuresError(CheckpointError, RuntimeError):
    """One or more ranks failed a collective checkpoint operation.

    ``failures`` maps rank to the error text that rank reported, so a 64-rank failure reads
    as one error; ``errors`` to the exception (for type checks, e.g. ``any_of``).
    """

    def __init__(self, what: str, failures: dict[int, str],
                 errors: dict[int, BaseException] | None = None):
        self.failures = dict(failures)
        self.errors = dict(errors or {})  # rank -> the exception itself, when known
        lines = [f"{what} failed on {len(failures)} rank(s):"]
        for rank in sorted(failures):
            lines.append(f"  rank {rank}: {failures[rank]}")
        super().__init__("\n".join(lines))

    def any_of(self, kind: type[BaseException]) -> bool:
        """True when some rank failed with a ``kind`` error."""
        return any(isinstance(e, kind) for e in self.errors.values())


class LeaseLostError(CheckpointError, RuntimeError):
    """This writer's lease was taken over: it is fenced off and its commit does not count."""


class FencedCheckpointError(CheckpointNotFoundError):
    """A manifest exists but was created by a writer that had lost the lease: no checkpoint."""


class AbandonedCheckpointError(CheckpointNotFoundError):
    """A committed version of a trajectory that a later resume went back past
    (:mod:`ckpt.root.lineage`): never resumed from, nor combined with the current
    trajectory's versions."""


class SaveAbandoned(CheckpointError):
    """A save was abandoned before its commit (shutdown without flushing)."""
