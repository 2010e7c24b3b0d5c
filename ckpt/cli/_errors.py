"""How the ``ckpt`` command (and ``python -m trainer``) report errors: one line each.

:func:`error_line` turns an exception into that line; :class:`OneLineArgumentParser` makes
argparse's usage errors read the same way (exit status 2).
"""

from __future__ import annotations

import argparse

from ckpt.cli._common import UsageError
from ckpt.errors import CheckpointError

__all__ = ["error_line", "OneLineArgumentParser"]


def error_line(exc: BaseException, explained: tuple[type, ...] = ()) -> str:
    """``exc`` as one line. Errors that explain themselves (project errors, UsageError and
    the types in ``explained``) read as their message; anything else is named by its type,
    with a pointer to --debug."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    for ln in lines[1:]:  # a per-rank list ("... failed on 2 rank(s):" then one per rank)
        text += (" " if text.endswith(":") else "; ") + ln
    if isinstance(exc, (CheckpointError, UsageError, *explained)):
        return text
    return f"{type(exc).__name__}: {text or 'no message'} (run with --debug for the traceback)"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (exit status 2), like every other error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

