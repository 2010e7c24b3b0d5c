"""What the ``ckpt`` commands share: opening a root, formatting, progress, the write lease.

Used by :mod:`ckpt.cli._main` (the parser and the read-only commands) and :mod:`ckpt.cli._admin`
(the commands that change a root).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import textwrap
import time
from typing import Any

from ckpt.errors import CheckpointError, CheckpointNotFoundError, LeaseHeldError
from ckpt.format import step_dirname
from ckpt.root import CORRUPT, CheckpointInfo, CheckpointStore, acquire_lease, release_lease
from ckpt.storage import Storage

__all__ = ["UsageError", "storage_options", "open_store", "fmt_bytes", "fmt_time",
           "fmt_seconds", "fmt_loss", "json_safe", "Progress", "info_row", "terminal_width",
           "format_table", "writer"]


class UsageError(ValueError):
    """Bad input found by the command line itself; the message names it and the fix."""


def storage_options(args) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if getattr(args, "endpoint_url", None):
        opts["client_kwargs"] = {"endpoint_url": args.endpoint_url}
    return opts


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_time(t: float | None) -> str:
    """Local time of ``t``; "-" when unset, "invalid" when not a representable time."""
    if not t:
        return "-"
    try:
        if not math.isfinite(t):
            return "invalid"
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError, TypeError):
        return "invalid"


def json_safe(row: dict[str, Any]) -> dict[str, Any]:
    """A listing row for JSON: an unusable ``created`` time is null; other non-finite
    numbers (a NaN loss) use the format's encoding (``jsonio``)."""
    created = row.get("created")
    if isinstance(created, float) and not math.isfinite(created):
        row = {**row, "created": None}
    return row


def open_store(args) -> CheckpointStore:
    """The store at ``args.url``, which must exist: a missing root is a typo, not "empty".

    On S3 a prefix exists only through its objects, so there only the bucket must exist
    (listing a missing bucket raises StorageUnavailableError naming it)."""
    store = CheckpointStore(args.url, storage_options(args))
    storage = store.storage
    if storage.has_folders:
        if not storage.exists(""):
            raise UsageError(f"checkpoint root {args.url} does not exist; check the path "
                             f"(the folder that holds the step_* folders)")
        if not storage.fs.isdir(storage.path()):
            raise UsageError(f"checkpoint root {args.url} is a file, not a folder; pass the "
                             f"folder that holds the step_* folders")
    return store


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal or forced)."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled, self.last = label, enabled, 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}%")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def info_row(store: CheckpointStore, step: int, check: str) -> CheckpointInfo:
    """``store.info``, except that a checkpoint whose manifest breaks the reader in an
    unforeseen way is listed as corrupt instead of ending the listing."""
    try:
        return store.info(step, check=check)
    except CheckpointError:
        raise  # storage unreachable: says so itself
    except Exception as exc:  # noqa: BLE001 - e.g. OverflowError on a damaged number
        return CheckpointInfo(step, CORRUPT, store.storage.describe(step_dirname(step)), 0,
                              problem=f"manifest cannot be read: {type(exc).__name__}: {exc}")


def fmt_loss(loss: Any) -> str:
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        return "-"
    return f"{loss:.4g}"


def terminal_width() -> int | None:
    """Columns of the terminal stdout is, or None when it is not one (a pipe, a file)."""
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def format_table(rows: list[tuple[str, ...]], width: int | None) -> list[str]:
    """Rows as aligned columns. The last column is free text: on a terminal of ``width``
    columns it wraps under itself rather than past the edge, so nothing is cut; piped
    output keeps every row on one line (for grep and scripts)."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    room = (width - indent - 1) if width else 0
    out = []
    for r in rows:
        head = "  ".join(v.ljust(w) for v, w in zip(r[:-1], widths))
        last = r[-1]
        if width and room >= 20 and len(head) + 2 + len(last) > width - 1:
            parts = textwrap.wrap(last, room, break_long_words=True,
                                  break_on_hyphens=False) or [""]
            out.append(f"{head}  {parts[0]}".rstrip())
            out.extend(" " * indent + p for p in parts[1:])
        else:
            out.append(f"{head}  {last}".rstrip())
    return out


def fmt_seconds(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s < 120:
        return f"{s:.0f}s"
    if s < 2 * 3600:
        return f"{s / 60:.1f}m"
    if s < 2 * 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


@contextlib.contextmanager
def writer(args, command: str, *, force: bool = False):
    """Hold the root's write lease for one command, under the rules every writer follows.

    A live job's lease is refused (``--force`` takes it over and fences that job off); a
    dead holder's is taken at once when its death is certain (same host, pid gone), else
    after its TTL.
    """

    storage = Storage(args.url, storage_options(args))
    if storage.has_folders and not storage.exists(""):
        raise CheckpointNotFoundError(f"checkpoint root {args.url} does not exist")
    try:
        life = acquire_lease(storage, ttl_seconds=30.0, job_name=f"ckpt {command}",
                             force=force)
    except LeaseHeldError as exc:
        raise LeaseHeldError(f"{exc} `ckpt {command}` changes the root and needs its write "
                             f"lease: stop that job first, or pass --force to take the lease "
                             f"over (that job's later saves will not count).") from None
    try:
        yield life
    finally:
        release_lease(life)

