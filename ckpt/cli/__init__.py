"""The ``ckpt`` command: the operator's view of a checkpoint root.

``_main`` (the parser, :func:`main`), ``_read`` (list, verify, show, diff, history, export),
``_admin`` (pin, rollback, restore, gc: under the root's write lease), ``_common`` (opening
a root, formatting, progress), ``_inspection`` (read-only looks into a root: one
checkpoint, two compared, the job's history). Every failure is one line
(:func:`ckpt.errors.error_line`, shared with ``python -m trainer``).
"""

from ckpt.cli._main import main

__all__ = ["main"]
