"""What the ``ckpt`` commands share: opening a root, formatting, progress, the write lease.

Used by :mod:`ckpt.cli._main` (the parser and the read-only commands) and :mod:`ckpt.cli._admin`
(the commands that change a root).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import sys
import textwrap
import threading
import time
import unicodedata
from typing import Any, Callable

from ckpt.errors import CheckpointError, LeaseHeldError
from ckpt.format import step_dirname
from ckpt.root import CORRUPT, CheckpointInfo, CheckpointStore, acquire_lease, release_lease
from ckpt.storage import RetryPolicy, Storage

__all__ = ["UsageError", "storage_options", "open_storage", "open_store", "fmt_bytes",
           "fmt_time", "fmt_seconds", "fmt_loss", "json_safe", "Progress", "info_row",
           "terminal_width", "format_table", "writer", "printable", "arg_type", "retry_policy",
           "with_unit", "parse_step", "DEFAULT_RETRY_SECONDS", "UNANSWERED_SECONDS",
           "NOTICE_SECONDS"]

DEFAULT_RETRY_SECONDS = 120.0
"""How long (``--retry-for``) a request the storage throttles is retried: about as patient
as a job's save, whose attempts are retried too."""
UNANSWERED_SECONDS = 30.0
"""How long a request that fails without an answer (refused, timed out) is retried, at most."""
NOTICE_SECONDS = 2.0
"""How long the first request to a root may take before the command says it is waiting."""


class UsageError(ValueError):
    """Bad input found by the command line itself; the message names it and the fix."""


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type``, its ``ValueError`` message kept (argparse would
    put its own in place of it)."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def with_unit(parse: Callable[[str], Any], example: str) -> Callable[[str], Any]:
    """``parse``, refusing a bare number: ``--size 14`` would mean 14 bytes, never what was
    meant. ``example`` shows the fix."""
    def parse_with_unit(text: str):
        body = str(text).strip()
        body = body[:-2] if body.lower().endswith("/s") else body
        try:
            float(body)
        except ValueError:
            return parse(text)
        raise ValueError(f"{text!r} has no unit: write e.g. {body}{example} (B for bytes)")

    parse_with_unit.__name__ = parse.__name__
    return parse_with_unit


def parse_step(text: str) -> int:
    """A ``--step``: a training step, an integer >= 0."""
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise ValueError(f"invalid step {text!r}: pass a step number (an integer >= 0; "
                         f"`ckpt list` shows them)")
    return step


def storage_options(args) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if getattr(args, "endpoint_url", None):
        opts["client_kwargs"] = {"endpoint_url": args.endpoint_url}
    return opts


def retry_policy(args) -> RetryPolicy:
    """The command's storage retries: throttled requests for ``--retry-for`` (a bounded
    deadline, as patient as a job), unanswered ones for at most ``UNANSWERED_SECONDS``."""
    patience = getattr(args, "retry_for", None)
    patience = DEFAULT_RETRY_SECONDS if patience is None else patience
    return RetryPolicy(attempts=5, base_seconds=0.2, max_seconds=5.0,
                       deadline_seconds=min(UNANSWERED_SECONDS, patience),
                       throttled_seconds=patience)


def printable(text: Any) -> str:
    """``text`` safe for a terminal: control and format characters (an ESC, a newline, a
    bidi override in a key name) escaped as ``\\xNN``/``\\uNNNN``, everything else kept."""
    out = []
    for ch in str(text):
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


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


@contextlib.contextmanager
def _notice_if_slow(args, storage: Storage):
    """Say on stderr what is being tried when the first request to the root takes longer
    than ``NOTICE_SECONDS`` (an endpoint that does not answer keeps a request waiting for
    its timeout before the first retry is reported)."""
    def say() -> None:
        policy = storage.retry
        sys.stderr.write(
            f"ckpt {args.command}: no answer yet from {storage.backend.endpoint} for "
            f"{storage.url}; still trying (unanswered requests are retried for up to "
            f"{policy.deadline_seconds:.0f}s, throttled ones for up to "
            f"{policy.throttled_seconds:.0f}s; --retry-for changes it, Ctrl-C stops)\n")
        sys.stderr.flush()

    timer = threading.Timer(NOTICE_SECONDS, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def open_storage(args) -> Storage:
    """The storage at ``args.url``, reached once, which must exist: a missing root is a typo,
    not "empty" (a ``UsageError``, exit 2, for every command).

    On S3 a prefix exists only through its objects, so there only the bucket must exist
    (listing a missing bucket raises StorageUnavailableError naming it). Requests retry
    with :func:`retry_policy`; a first request that takes long is announced on stderr."""
    storage = Storage(args.url, storage_options(args), retry=retry_policy(args))
    with _notice_if_slow(args, storage):
        if not storage.has_folders:
            storage.listdir("")  # reaches the endpoint and the bucket
        elif not storage.exists(""):
            raise UsageError(f"checkpoint root {args.url} does not exist; check the path "
                             f"(the folder that holds the step_* folders)")
        elif not storage.fs.isdir(storage.path()):
            raise UsageError(f"checkpoint root {args.url} is a file, not a folder; pass the "
                             f"folder that holds the step_* folders")
    return storage


def open_store(args) -> CheckpointStore:
    """The store at ``args.url`` (:func:`open_storage`)."""
    return CheckpointStore(open_storage(args))


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
    rows = [tuple(printable(v) for v in r) for r in rows]
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

    storage = open_storage(args)
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

