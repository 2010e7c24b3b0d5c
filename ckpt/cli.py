"""ckpt: the operator's view of a checkpoint root.

    ckpt list URL [--all] [--json] [--check none|size|full]
    ckpt verify URL [--step N | --id ID] [--size-only] [--progress]
    ckpt show URL [--step N | --id ID] [--tensors] [--json]
                                    (what a checkpoint holds, who wrote it, its metadata)
    ckpt diff URL A B [--json]      (A, B: steps or ids; tensor by tensor; exit 0 when
                                     identical, 1 when they differ, 2 on trouble: a
                                     missing or corrupt checkpoint too)
    ckpt history URL [--json]       (the job's failures, the MTBF `auto` uses, the lease)
    ckpt export URL [--step N] --out FILE(.pt|.safetensors) [--select PREFIX ...]
                    [--dtype bf16] [--attachments DIR]
    ckpt export URL [--step N] --format hf --out DIR [--select PREFIX] [--dtype bf16]
                    [--max-shard-size 5GB] [--force]
                                    (a Hugging Face folder: sharded safetensors, index and the
                                     checkpoint's attachments, e.g. config.json)
    ckpt pin URL --step N [--force] / ckpt unpin URL --step N
                                    (pin verifies every checksum first; --force pins a
                                     damaged checkpoint anyway)
    ckpt rollback URL --step N [--force]
                                    (un-commit newer checkpoints; reversible, deletes nothing;
                                     refused while a live job holds the write lease)
    ckpt restore URL --id ID [--replace]   (re-commit a rolled-back checkpoint)
    ckpt gc URL [--rolled-back [--older-than 7d]] [--yes]
                                    (remove aborted saves' leftovers; dry run by default)
    ckpt plan ...                   (checkpoint interval from size, bandwidth, MTBF)

S3 endpoints and credentials come from the usual AWS environment variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) or --endpoint-url.
Exit status: 0 ok, 1 a checkpoint is corrupt or missing, 2 bad usage or input. Every error
is one line on stderr naming what is wrong and how to fix it; --debug (anywhere on the
command line) adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import sys
import textwrap
import time
import traceback
from typing import Any, Sequence

from ckpt import jsonio
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LeaseHeldError,
)
from ckpt.manifest import step_dirname
from ckpt.store import CORRUPT, CheckpointInfo, CheckpointStore

__all__ = ["main", "UsageError", "error_line", "format_table", "OneLineArgumentParser"]


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


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    """A listing row for JSON: an unusable ``created`` time is null; other non-finite
    numbers (a NaN loss) use the format's encoding (``jsonio``)."""
    created = row.get("created")
    if isinstance(created, float) and not math.isfinite(created):
        row = {**row, "created": None}
    return row


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
    if args.all:
        infos = store.list(check=args.check, all_versions=True)
    else:
        infos = [_info(store, step, args.check) for step in store.steps()]
    if args.json:
        print(jsonio.dumps([_json_safe(i.to_json()) for i in infos], indent=1).decode())
        return 0
    if not infos:
        print(f"no checkpoints under {args.url}")
        return 0
    rows = [("STEP", "ID", "STATUS", "SIZE", "CREATED", "LOSS", "NOTE")]
    for i in infos:
        rows.append((str(i.step), i.id or "-", i.status, _fmt_bytes(i.bytes),
                     _fmt_time(i.created), _fmt_loss((i.user_metadata or {}).get("loss")),
                     " ".join((i.problem or "").replace(store.storage.url + "/", "").split())))
    for line in format_table(rows, _terminal_width()):
        print(line)
    return 0


def _fmt_loss(loss: Any) -> str:
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        return "-"
    return f"{loss:.4g}"


def _terminal_width() -> int | None:
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


def cmd_verify(args) -> int:
    store = _open_store(args)
    if args.id is not None:
        entry = store.life.find(args.id)
        if entry.manifest is None:
            print(f"id {args.id} (step {entry.step}): {entry.status}: {entry.problem}")
            return 1
        progress = _Progress(f"id {args.id}", args.progress or sys.stderr.isatty())
        try:
            store.verify_manifest(entry.manifest, full=not args.size_only, progress=progress)
        except CheckpointError as exc:
            print(f"id {args.id} (step {entry.step}, {entry.status}): CORRUPT: {exc}")
            return 1
        print(f"id {args.id} (step {entry.step}, {entry.status}): ok "
              f"({len(entry.manifest.files)} files, {_fmt_bytes(entry.manifest.total_bytes)})")
        return 0
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


def _select(store: CheckpointStore, text: str | None = None, *, step: int | None = None,
            save_id: str | None = None):
    """A checkpoint named by ``--step``/``--id``, or by ``text``: a step number or an id."""
    from ckpt import inspect

    if text is not None:
        text = text.strip()
        if text.isdigit():
            step = int(text)
        elif text.startswith("id:"):
            save_id = text[3:]
        else:
            save_id = text
    if step is not None and save_id is not None:
        raise UsageError("pass --step or --id, not both")
    return inspect.select(store, step, save_id)


def cmd_show(args) -> int:
    from ckpt import inspect

    store = _open_store(args)
    info = inspect.show(store, _select(store, step=args.step, save_id=args.id),
                        with_tensors=args.tensors)
    if args.json:
        print(jsonio.dumps(_json_safe(info), indent=1).decode())
        return 0
    layout = info["layout"] or {}
    shown = " ".join(f"{k}={v}" for k, v in layout.items() if k != "world_size")
    meta = {k: v for k, v in (info["user_metadata"] or {}).items() if k != "config"}
    w = info["writer"] or {}
    lines = [
        ("url", info["url"]),
        ("created", _fmt_time(info["created_unix"])),
        ("layout", f"{shown or '-'} (world size {info['world_size']})"),
        ("tensors", f"{info['num_tensors']} ({_fmt_bytes(info['tensor_bytes'])}); "
                    f"{info['num_objects']} other values"),
        ("files", f"{info['num_files']} ({_fmt_bytes(info['total_bytes'])})"),
        ("fingerprint", info["config_fingerprint"] or "-"),
        ("writer", f"owner {w.get('owner', '-')}, lease generation "
                   f"{w.get('lease_generation', '-')}, job {w.get('job', '-')}"),
        ("versions", ", ".join(f"{k} {v}" for k, v in (info["versions"] or {}).items()) or "-"),
        ("metadata", ", ".join(f"{k}={jsonio.dumps(v).decode()}" for k, v in meta.items())
         or "-"),
    ]
    config = (info["user_metadata"] or {}).get("config")
    if isinstance(config, dict):
        lines.append(("config", f"stored ({len(config)} sections; --json shows it)"))
    print(f"step {info['step']}  id {info['id']}  {info['status']}")
    for k, v in lines:
        print(f"  {k:<12} {v}")
    if args.tensors:
        rows = [("KEY", "SHAPE", "DTYPE", "BYTES")]
        rows += [(k, "x".join(map(str, t["shape"])) or "scalar", t["dtype"], str(t["bytes"]))
                 for k, t in info["tensors"].items()]
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        for r in rows:
            print("  " + "  ".join(v.ljust(wd) for v, wd in zip(r, widths)).rstrip())
    return 0


def cmd_diff(args) -> int:
    """Exit 0 when the two checkpoints hold the same values, 1 when they differ, 2 when
    they could not be compared (missing or corrupt, a tensor over --max-tensor-bytes, bad
    input): as with diff(1), 1 means "different" only."""
    from ckpt import inspect

    store = _open_store(args)
    try:
        a, b = _select(store, args.a), _select(store, args.b)
        progress = _Progress("diff", args.progress or sys.stderr.isatty())
        result = inspect.diff(store, a, b, max_tensor_bytes=args.max_tensor_bytes,
                              progress=progress)
    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
        raise UsageError(error_line(exc)) from exc
    if args.json:
        print(jsonio.dumps(result, indent=1).decode())
    else:
        print(f"a: {a.label()}  b: {b.label()}")
        rows = [("STATUS", "KEY", "DETAIL")]
        for r in result["tensors"]:
            if r["status"] == "identical" and not args.all:
                continue
            detail = ""
            if "max_abs_diff" in r:
                detail = f"max abs diff {r['max_abs_diff']:.4g}"
            elif r["status"] in ("shape_changed", "dtype_changed"):
                detail = (f"{r['dtype']}{r['shape']} -> {r['b_dtype']}{r['b_shape']}")
            elif r["status"] == "not_compared":
                detail = r["reason"]
            elif r["status"] in ("added", "removed"):
                detail = f"{r['dtype']}{r['shape']}"
            rows.append((r["status"], r["key"], detail))
        for r in result["objects"]:
            if r["status"] == "identical" and not args.all:
                continue
            detail = f"{r['a']} -> {r['b']}" if "a" in r else ""
            rows.append((r["status"], r["key"], detail))
        if len(rows) > 1:
            for line in format_table(rows, _terminal_width()):
                print(line)
        counts = ", ".join(f"{n} {k.replace('_', ' ')}"
                           for k, n in sorted(result["counts"].items()))
        print(f"{len(result['tensors'])} tensors, {len(result['objects'])} other values: "
              f"{counts or 'nothing to compare'}")
    if result["not_compared"]:
        n = len(result["not_compared"])
        raise UsageError(f"{n} tensor(s) not compared (first: {result['not_compared'][0]}): "
                         f"the checkpoints chunk them differently and they are larger than "
                         f"--max-tensor-bytes={args.max_tensor_bytes}; raise it to compare "
                         f"them whole")
    return 0 if result["identical"] else 1


def _fmt_seconds(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s < 120:
        return f"{s:.0f}s"
    if s < 2 * 3600:
        return f"{s / 60:.1f}m"
    if s < 2 * 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def cmd_history(args) -> int:
    from ckpt import inspect

    if not (math.isfinite(args.mtbf_hours) and args.mtbf_hours > 0):
        raise UsageError(f"--mtbf-hours {args.mtbf_hours}: pass the prior MTBF in hours, > 0 "
                         f"(the job's checkpoint.mtbf_hours)")
    store = _open_store(args)
    try:
        info = inspect.history(store, mtbf_prior_seconds=args.mtbf_hours * 3600.0)
    except CheckpointError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(jsonio.dumps(info, indent=1).decode())
        return 0
    if not info["found"]:
        print(f"no failure history at {info['file']} (no job with a cadence has run here, "
              f"or none has saved its history yet)")
    else:
        print(f"failure history: {info['file']}")
        print(f"  failures     {info['num_failures']}")
        for f in info["failures"]:
            print(f"    {_fmt_time(f['unix'])}")
        print(f"  uptime       {_fmt_seconds(info['uptime_seconds'])}")
        print(f"  MTBF         {_fmt_seconds(info['mtbf_seconds'])} used by the auto cadence "
              f"(prior {_fmt_seconds(info['mtbf_prior_seconds'])} with weight "
              f"{info['prior_weight']:g}; observed "
              f"{_fmt_seconds(info['mtbf_observed_seconds'])})")
    lease = info["lease"]
    if lease is None:
        print("  lease        none (no job has written here)")
    elif lease.get("damaged"):
        print("  lease        damaged record (the next job takes it over)")
    else:
        state = "released" if lease.get("released") else "held"
        print(f"  lease        {state}, generation {lease.get('generation', '-')}, holder "
              f"{lease.get('holder', '-')} (job {lease.get('job', '-')}, host "
              f"{lease.get('host', '-')}, pid {lease.get('pid', '-')}), last heartbeat "
              f"{_fmt_time(lease.get('heartbeat_unix'))}")
    return 0


def cmd_export(args) -> int:
    from ckpt.export import check_out_dir, check_out_file, export, parse_dtype
    from ckpt.plan import parse_size

    if args.out is None and args.attachments is None:
        raise UsageError("give --out FILE (or a folder with --format hf), --attachments DIR, "
                         "or both")
    if args.format != "hf" and args.max_shard_size is not None:
        raise UsageError("--max-shard-size applies to --format hf only")
    if args.dtype is not None:
        parse_dtype(args.dtype)
    parse_size(args.max_shard_size or "5GB")
    if args.out is not None:
        try:  # before reading any checkpoint data
            if args.format == "hf":
                check_out_dir(args.out, force=args.force)
            else:
                check_out_file(args.out)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    progress = _Progress("export", args.progress or sys.stderr.isatty())
    m = export(_open_store(args).storage, args.step, args.out, select=args.select,
               progress=progress if args.out is not None else None,
               dtype=args.dtype, format=args.format, max_shard_size=args.max_shard_size or "5GB",
               force=args.force, attachments_dir=args.attachments)
    if args.out is not None:
        kept = f"{len(args.select)} prefix(es) selected from " if args.select else ""
        print(f"exported step {m.step} ({kept}{len(m.tensors)} tensors) to {args.out}")
    if args.attachments is not None:
        names = ", ".join(sorted(m.attachments)) or "none"
        print(f"wrote {len(m.attachments)} attachment(s) of step {m.step} to "
              f"{args.attachments}: {names}")
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
    with _writer(args, "pin" if pinned else "unpin"):
        pins = set_pinned(store, args.step, pinned)
    print(f"pinned steps: {sorted(pins) or 'none'}")
    return 0


@contextlib.contextmanager
def _writer(args, command: str, *, force: bool = False):
    """Hold the root's write lease for one command, under the rules every writer follows.

    A live job's lease is refused (``--force`` takes it over and fences that job off); a
    dead holder's is taken at once when its death is certain (same host, pid gone), else
    after its TTL.
    """
    from ckpt.commit import acquire_lease, release_lease
    from ckpt.storage import Storage

    storage = Storage(args.url, _storage_options(args))
    if not storage.exists("") and not storage.is_s3:
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


def cmd_rollback(args) -> int:
    with _writer(args, "rollback", force=args.force) as life:
        store = CheckpointStore(life.storage, lifecycle=life)
        store.verify(args.step, full=True)
        for s in reversed([s for s in store.committed_steps() if s > args.step]):
            try:
                kept = life.uncommit(s)
            except CheckpointError as exc:
                print(f"step {s}: not a valid checkpoint, left as it is ({exc})")
                continue
            print(f"step {s}: rolled back (id {kept}; `ckpt restore {args.url} --id {kept}` "
                  f"re-commits it)")
    print(f"step {args.step} is now the latest checkpoint; a resumed job starts from it")
    return 0


def cmd_restore(args) -> int:
    with _writer(args, "restore", force=args.force) as life:
        m = life.restore(args.id, replace=args.replace)
    print(f"step {m.step}: restored id {m.save_id}; it is committed again")
    return 0


def cmd_gc(args) -> int:
    """Remove dead attempts' files (and rolled-back checkpoints when asked). Dry run unless
    ``--yes``; either way the root's lease is respected."""
    from ckpt.cadence import parse_duration
    from ckpt.commit import ROLLED_BACK, Lifecycle

    older = parse_duration(args.older_than) if args.older_than else 0.0

    def plan(life) -> tuple[list, list]:
        rolled = []
        if args.rolled_back:
            now = time.time()
            for step in life.steps():
                for e in life.entries(step):
                    if e.status == ROLLED_BACK and e.manifest is not None and \
                            now - e.manifest.created_unix >= older:
                        rolled.append(e)
        return life.leftovers(), rolled

    def show(leftovers, rolled, verb: str) -> None:
        if args.json:
            print(jsonio.dumps({
                "dry_run": not args.yes,
                "leftovers": [{"step": step, "files": names} for step, names in leftovers],
                "rolled_back": [{"step": e.step, "id": e.id,
                                 "bytes": e.manifest.total_bytes} for e in rolled]},
                indent=1).decode())
            return
        for step, names in leftovers:
            print(f"step {step}: {verb} {len(names)} leftover file(s) of aborted saves")
        for e in rolled:
            print(f"step {e.step}: {verb} rolled-back checkpoint id {e.id} "
                  f"({_fmt_bytes(e.manifest.total_bytes)})")
        if not leftovers and not rolled:
            print("nothing to remove")

    if not args.yes:
        from ckpt.lease import Lease
        from ckpt.storage import Storage

        storage = Storage(args.url, _storage_options(args))
        info, _ = Lease(storage).read()
        if info is not None and Lease(storage).expired_because(info) is None:
            raise LeaseHeldError(f"{args.url} is being written by job {info.get('job')!r} "
                                 f"(host {info.get('host')}, pid {info.get('pid')}): its save "
                                 f"in flight would look like leftovers. Run gc when it stops.")
        leftovers, rolled = plan(Lifecycle(storage))
        show(leftovers, rolled, "would remove")
        if (leftovers or rolled) and not args.json:
            print("dry run: nothing removed; pass --yes to remove these")
        return 0
    with _writer(args, "gc", force=args.force) as life:
        leftovers, rolled = plan(life)
        life.cleanup()
        for e in rolled:
            life.delete_entry(e)
        show(leftovers, rolled, "removed")
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
    sp.add_argument("--all", action="store_true",
                    help="every version of every step, each with its id (rolled-back, "
                         "incomplete and fenced ones too)")
    sp.set_defaults(fn=cmd_list)
    sp = add("verify", "full checksum pass over one or all checkpoints")
    sp.add_argument("--step", type=int)
    sp.add_argument("--id", help="verify one version by id (e.g. a rolled-back one)")
    sp.add_argument("--size-only", action="store_true", help="check sizes, not checksums")
    sp.add_argument("--progress", action="store_true", help="show progress even when piped")
    sp.set_defaults(fn=cmd_verify)
    sp = add("show", "what one checkpoint holds: layout, tensors, sizes, metadata, writer")
    sp.add_argument("--step", type=int, help="default: the newest committed")
    sp.add_argument("--id", help="one version by id (e.g. a rolled-back one)")
    sp.add_argument("--tensors", action="store_true",
                    help="list every tensor's shape, dtype and size")
    sp.add_argument("--json", action="store_true", help="print a JSON object")
    sp.set_defaults(fn=cmd_show)
    sp = add("diff", "compare two checkpoints tensor by tensor (exit 1 when they differ)")
    sp.add_argument("a", help="a step number or a checkpoint id")
    sp.add_argument("b", help="a step number or a checkpoint id")
    sp.add_argument("--all", action="store_true", help="list identical keys too")
    sp.add_argument("--max-tensor-bytes", type=int, default=1 << 30, metavar="N",
                    help="largest tensor assembled whole when the two checkpoints chunk it "
                         "differently (default: 1 GiB)")
    sp.add_argument("--progress", action="store_true", help="show progress even when piped")
    sp.add_argument("--json", action="store_true", help="print a JSON object")
    sp.set_defaults(fn=cmd_diff)
    sp = add("history", "the job's failure history, the MTBF the auto cadence uses, the lease")
    sp.add_argument("--mtbf-hours", type=float, default=24.0,
                    help="the prior MTBF, as the job's checkpoint.mtbf_hours (default: 24)")
    sp.add_argument("--json", action="store_true", help="print a JSON object")
    sp.set_defaults(fn=cmd_history)
    sp = add("export", "consolidate a checkpoint into one .pt or .safetensors file, or a "
                       "Hugging Face folder")
    sp.add_argument("--step", type=int, help="default: the newest committed")
    sp.add_argument("--out", help="a .pt/.pth or .safetensors file, or a folder with --format hf")
    sp.add_argument("--format", choices=("pt", "safetensors", "hf"),
                    help="default: from the --out file name; hf: a folder of sharded "
                         "safetensors, their index and the attachments")
    sp.add_argument("--select", action="append", metavar="PREFIX",
                    help="keep only keys under this prefix, stripped (e.g. app.model.); "
                         "repeatable")
    sp.add_argument("--dtype", help="cast floating tensors: bf16, fp16, fp32 (or full names)")
    sp.add_argument("--max-shard-size", metavar="SIZE",
                    help="with --format hf: the largest shard file (default 5GB; e.g. 10MB)")
    sp.add_argument("--force", action="store_true",
                    help="replace a non-empty --out folder / existing attachment files")
    sp.add_argument("--attachments", metavar="DIR",
                    help="also write the checkpoint's attachments into DIR")
    sp.add_argument("--progress", action="store_true", help="show progress even when piped")
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
                    help="take the write lease from a live job (its later saves stop counting)")
    sp.set_defaults(fn=cmd_rollback)
    sp = add("restore", "re-commit a rolled-back checkpoint by its id (see list --all)")
    sp.add_argument("--id", required=True, help="the checkpoint id, from `ckpt list --all`")
    sp.add_argument("--replace", action="store_true",
                    help="roll back the committed checkpoint of that step to make room")
    sp.add_argument("--force", action="store_true",
                    help="take the write lease from a live job (its later saves stop counting)")
    sp.set_defaults(fn=cmd_restore)
    sp = add("gc", "remove aborted saves' leftovers (and rolled-back checkpoints if asked)")
    sp.add_argument("--rolled-back", action="store_true",
                    help="also remove rolled-back checkpoints")
    sp.add_argument("--older-than", metavar="DURATION",
                    help="with --rolled-back: only those created longer ago (e.g. 7d, 12h)")
    sp.add_argument("--yes", action="store_true", help="remove (default: dry run)")
    sp.add_argument("--force", action="store_true",
                    help="take the write lease from a live job (its later saves stop counting)")
    sp.add_argument("--json", action="store_true", help="print a JSON object")
    sp.set_defaults(fn=cmd_gc)
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
