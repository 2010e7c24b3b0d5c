"""``ckpt``: the operator's view of a checkpoint root.

    ckpt list URL [--json] [--check none|size|full]
    ckpt verify URL [--step N] [--size-only] [--progress]
    ckpt export URL [--step N] --out FILE(.pt|.safetensors)
    ckpt pin URL --step N / ckpt unpin URL --step N
    ckpt rollback URL --step N [--force]
                                    (un-commit newer checkpoints; reversible, deletes nothing;
                                     refused while a job holds the write lease)
    ckpt plan ...                   (checkpoint interval from size, bandwidth, MTBF)

S3 endpoints and credentials come from the usual AWS environment variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) or ``--endpoint-url``.
Exit status: 0 ok, 1 a checkpoint is corrupt or missing, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

from ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ckpt.store import CheckpointStore

__all__ = ["main"]


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
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


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


def cmd_list(args) -> int:
    store = CheckpointStore(args.url, _storage_options(args))
    infos = store.list(check=args.check)
    if args.json:
        print(json.dumps([i.to_json() for i in infos], indent=1))
        return 0
    if not infos:
        print(f"no checkpoints under {args.url}")
        return 0
    rows = [("STEP", "STATUS", "SIZE", "CREATED", "LOSS", "NOTE")]
    for i in infos:
        loss = (i.user_metadata or {}).get("loss")
        rows.append((str(i.step), i.status, _fmt_bytes(i.bytes), _fmt_time(i.created),
                     f"{loss:.4g}" if isinstance(loss, (int, float)) else "-",
                     (i.problem or "")[:70]))
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


def cmd_export(args) -> int:
    from ckpt.export import export

    m = export(args.url, args.step, args.out, storage_options=_storage_options(args))
    print(f"exported step {m.step} ({len(m.tensors)} tensors) to {args.out}")
    return 0


def cmd_pin(args, pinned: bool) -> int:
    from ckpt.retention import set_pinned

    store = CheckpointStore(args.url, _storage_options(args))
    store.read_manifest(args.step)  # must exist
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
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, AttributeError):
        return "a job whose lease file cannot be read"
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
    p = argparse.ArgumentParser(prog="ckpt", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
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
    sp = add("pin", "protect a checkpoint from retention")
    sp.add_argument("--step", type=int, required=True)
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
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
        print(f"ckpt: {exc}", file=sys.stderr)
        return 1
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"ckpt: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
