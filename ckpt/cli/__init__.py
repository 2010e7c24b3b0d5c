"""The ``ckpt`` command: the operator's view of a checkpoint root.

``_main`` (the parser, :func:`main`), ``_read`` (list, verify, show, diff, history, export),
``_admin`` (pin, rollback, restore, gc: under the root's write lease), ``_common`` (opening
a root, formatting, progress), ``_errors`` (every failure as one line; shared with
``python -m trainer``), ``inspection`` (read-only looks into a root: one checkpoint, two
compared, the job's history).
"""

from ckpt.cli._errors import OneLineArgumentParser, error_line
from ckpt.cli._main import build_parser, main

__all__ = ["main", "build_parser", "error_line", "OneLineArgumentParser"]
