"""ckpt: the operator's view of a checkpoint root.

    ckpt list URL [--json] [--check none|size|full]
    ckpt verify URL [--step N] [--size-only] [--progress]
    ckpt export URL [--step N] --out FILE(.pt|.safetensors)
    ckpt pin URL --step N [--force] / ckpt unpin URL --step N
                                    (pin verifies every checksum first; --force pins a
                                     damaged checkpoint anyway)
    ckpt rollback URL --step N [--force]
                                    (un-commit newer checkpoints; reversible, deletes nothing;
                                     refused while a job holds the write lease)
    ckpt plan ...                   (checkpoint interval from size, bandwidth, MTBF)

S3 endpoints and credentials come from the usual AWS environment variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) or --endpoint-url.
Exit status: 0 ok, 1 a checkpoint is corrupt or missing, 2 bad usage or input. Every error
is one line on stderr naming what is wrong and how to fix it; --debug (anywhere on the
command line) adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Sequence

from ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ckpt.manifest import step_dirname
from ckpt.store import CORRUPT, CheckpointInfo, CheckpointStore

__all__ = ["main", "UsageError", "error_line", "OneLineArgumentParser"]


class UsageError(ValueError):
    """Bad input found by the command line itself; the message names it and the fix."""


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


def _storage_options(args) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if getattr(args, "endpoint_url", None):
        opts["client_kwargs"] = {"endpoint_url": args.endpoint_url}
    return opts


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt_time(t: float | None) -> str:
    """Local time of ``t``; "-" when unset, "invalid" when not a representable time."""
    if not t:
        return "-"
    try:
        if not math.isfinite(t):
            return "invalid"
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError, TypeError):
        return "invalid"


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as None: NaN and Infinity are not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _open_store(args) -> CheckpointStore:
    """The store at ``args.url``, which must exist: a missing root is a typo, not "empty".

    On S3 a prefix exists only through its objects, so there only the bucket must exist
    (listing a missing bucket raises StorageUnavailableError naming it)."""
    store = CheckpointStore(args.url, _storage_options(args))
    storage = store.storage
    if not storage.is_s3:
        if not storage.exists(""):
            raise UsageError(f"checkpoint root {args.url} does not exist; check the path "
                             f"(the folder that holds the step_* folders)")
        if not storage.fs.isdir(storage.path()):
            raise UsageError(f"checkpoint root {args.url} is a file, not a folder; pass the "
                             f"folder that holds the step_* folders")
    return store


class _Progress:
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


def _info(store: CheckpointStore, step: int, check: str) -> CheckpointInfo:
    """``store.info``, except that a checkpoint whose manifest breaks the reader in an
    unforeseen way is listed as corrupt instead of ending the listing."""
    try:
        return store.info(step, check=check)
    except CheckpointError:
        raise  # storage unreachable: says so itself
    except Exception as exc:  # noqa: BLE001 - e.g. OverflowError on a damaged number
        return CheckpointInfo(step, CORRUPT, store.storage.describe(step_dirname(step)), 0,
                              problem=f"manifest cannot be read: {type(exc).__name__}: {exc}")


def cmd_list(args) -> int:
    store = _open_store(args)
    infos = [_info(store, step, args.check) for step in store.steps()]
    if args.json:
        print(json.dumps([_json_safe(i.to_json()) for i in infos], indent=1))
        return 0
    if not infos:
        print(f"no checkpoints under {args.url}")
        return 0
    rows = [("STEP", "STATUS", "SIZE", "CREATED", "LOSS", "NOTE")]
    for i in infos:
        loss = (i.user_metadata or {}).get("loss")
        rows.append((str(i.step), i.status, _fmt_bytes(i.bytes), _fmt_time(i.created),
                     f"{loss:.4g}" if isinstance(loss, (int, float)) else "-",
                     " ".join((i.problem or "").split())[:70]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


def cmd_verify(args) -> int:
    store = CheckpointStore(args.url, _storage_options(args))
    steps = [args.step] if args.step is not None else store.committed_steps()
    if not steps:
        print(f"no committed checkpoints under {args.url}", file=sys.stderr)
        return 1
    bad = 0
    for step in steps:
        progress = _Progress(f"step {step}", args.progress or sys.stderr.isatty())
        try:
            m = store.verify(step, full=not args.size_only, progress=progress)
            print(f"step {step}: ok ({len(m.files)} files, {_fmt_bytes(m.total_bytes)})")
        except CheckpointError as exc:
            bad += 1
            print(f"step {step}: CORRUPT: {exc}")
    return 1 if bad else 0


def _check_out(out: str) -> None:
    """Refuse an ``--out`` that cannot be written before reading any checkpoint data."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise UsageError(f"--out {out} is a folder; name a file in it, such as "
                         f"{os.path.join(out, 'model.safetensors')}")
    if not os.path.exists(folder):
        raise UsageError(f"output folder {folder} does not exist; create it or choose "
                         f"another --out")
    if not os.path.isdir(folder):
        raise UsageError(f"output folder {folder} is a file, not a folder; choose another "
                         f"--out")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"output folder {folder} is not writable; fix its permissions or "
                         f"choose another --out")


def cmd_export(args) -> int:
    from ckpt.export import export

    _check_out(args.out)
    m = export(_open_store(args).storage, args.step, args.out)
    print(f"exported step {m.step} ({len(m.tensors)} tensors) to {args.out}")
    return 0


def cmd_pin(args, pinned: bool) -> int:
    """Pin after a full verification (a pin keeps a checkpoint for good: it must be one
    worth keeping), or anyway with ``--force``. Unpin needs no readable checkpoint."""
    from ckpt.retention import read_pins, set_pinned

    store = _open_store(args)
    if pinned and not args.force:
        progress = _Progress(f"verifying step {args.step}", sys.stderr.isatty())
        try:
            store.verify(args.step, full=True, progress=progress)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"refusing to pin step {args.step}: {exc} (pass --force to pin it anyway)",
                path=exc.path) from exc
    elif pinned or args.step not in read_pins(store, strict=True):
        try:
            store.read_manifest(args.step)  # must exist
        except CorruptCheckpointError:
            pass  # --force, or unpin: a damaged manifest is no reason to refuse
    pins = set_pinned(store, args.step, pinned)
    print(f"pinned steps: {sorted(pins) or 'none'}")
    return 0


def _live_writer(store: CheckpointStore) -> str | None:
    """The job holding a fresh write lease on the root, described; None if there is none."""
    from ckpt.lease import LEASE_NAME

    try:
        info = json.loads(store.storage.read_bytes(LEASE_NAME))
        age = time.time() - float(info.get("heartbeat_unix", 0))
        ttl = float(info.get("ttl_seconds") or 0)
        if not (math.isfinite(age) and math.isfinite(ttl)):
            raise ValueError("non-finite time")
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, AttributeError, ArithmeticError, RecursionError):
        return f"a job whose lease file {store.storage.describe(LEASE_NAME)} cannot be read"
    if age > ttl:
        return None
    return (f"job {info.get('job')!r} (host {info.get('host')}, pid {info.get('pid')}, "
            f"heartbeat {age:.0f}s ago)")


def cmd_rollback(args) -> int:
    store = CheckpointStore(args.url, _storage_options(args))
    writer = _live_writer(store)
    if writer and not args.force:
        print(f"ckpt: {args.url} is being written by {writer}. Stop that job first (a rollback "
              f"under a running job races with its saves), or pass --force.", file=sys.stderr)
        return 2
    store.verify(args.step, full=True)
    newer = [s for s in store.committed_steps() if s > args.step]
    for s in reversed(newer):
        print(f"step {s}: un-committed (manifest kept as {store.uncommit(s)})")
    print(f"step {args.step} is now the latest checkpoint; a resumed job starts from it")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="ckpt", description=__doc__.split("\n")[0])
    p.add_argument("--debug", action="store_true",
                   help="on an error, print the traceback too")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        # Also accepted after the command; SUPPRESS keeps "ckpt --debug list" working.
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the traceback too")
        if name != "plan":
            sp.add_argument("url", help="checkpoint root: a path or URL (s3://bucket/prefix)")
            sp.add_argument("--endpoint-url", help="S3 endpoint (else AWS_ENDPOINT_URL)")
        return sp

    sp = add("list", "list checkpoints with their status")
    sp.add_argument("--json", action="store_true", help="print a JSON list")
    sp.add_argument("--check", choices=("none", "size", "full"), default="size",
                    help="how hard to check each committed checkpoint (default: size)")
    sp.set_defaults(fn=cmd_list)
    sp = add("verify", "full checksum pass over one or all checkpoints")
    sp.add_argument("--step", type=int)
    sp.add_argument("--size-only", action="store_true", help="check sizes, not checksums")
    sp.add_argument("--progress", action="store_true", help="show progress even when piped")
    sp.set_defaults(fn=cmd_verify)
    sp = add("export", "consolidate a checkpoint into one .pt or .safetensors file")
    sp.add_argument("--step", type=int, help="default: the newest committed")
    sp.add_argument("--out", required=True)
    sp.set_defaults(fn=cmd_export)
    sp = add("pin", "protect a checkpoint from retention (after a full checksum pass)")
    sp.add_argument("--step", type=int, required=True)
    sp.add_argument("--force", action="store_true",
                    help="pin even if the checkpoint fails verification")
    sp.set_defaults(fn=lambda a: cmd_pin(a, True))
    sp = add("unpin", "remove a pin")
    sp.add_argument("--step", type=int, required=True)
    sp.set_defaults(fn=lambda a: cmd_pin(a, False))
    sp = add("rollback", "make STEP the latest: un-commit newer checkpoints (reversible)")
    sp.add_argument("--step", type=int, required=True)
    sp.add_argument("--force", action="store_true",
                    help="roll back even while a job holds the write lease")
    sp.set_defaults(fn=cmd_rollback)
    try:
        from ckpt.plan import add_plan_arguments, run_plan
    except ImportError:  # pragma: no cover
        pass
    else:
        sp = add("plan", "recommend a checkpoint interval")
        add_plan_arguments(sp)
        sp.set_defaults(fn=run_plan)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and an exit status: 1 for a
    corrupt or missing checkpoint, 2 for anything else (bad usage, input or storage)."""
    args = build_parser().parse_args(argv)
    prog = f"ckpt {args.command}"
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place errors become exit statuses
        if args.debug:
            traceback.print_exc()
        print(f"{prog}: {error_line(exc)}", file=sys.stderr)
        return 1 if isinstance(exc, (CorruptCheckpointError, CheckpointNotFoundError)) else 2


if __name__ == "__main__":
    sys.exit(main())
