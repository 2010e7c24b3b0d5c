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
import math
import sys
import traceback
from typing import Sequence

from ckpt import jsonio
from ckpt.cli_admin import cmd_gc, cmd_pin, cmd_restore, cmd_rollback
from ckpt.cli_common import (
    Progress,
    UsageError,
    fmt_bytes,
    fmt_loss,
    fmt_seconds,
    fmt_time,
    format_table,
    info_row,
    json_safe,
    open_store,
    terminal_width,
)
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from ckpt.store import CheckpointStore

__all__ = ["main", "UsageError", "error_line", "format_table", "OneLineArgumentParser"]


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


def cmd_list(args) -> int:
    tiers = [("durable", open_store(args))]
    for local in args.local or ():
        if local.rstrip("/") == args.url.rstrip("/"):
            raise UsageError(f"--local {local} is the durable root itself; pass the local "
                             f"tier's folder (checkpoint.local_root)")
        tiers.append((f"local:{local}" if len(args.local) > 1 else "local",
                      open_store(argparse.Namespace(**{**vars(args), "url": local}))))
    rows_of: list[tuple[str, CheckpointStore, object]] = []
    for tier, store in tiers:
        if args.all:
            infos = store.list(check=args.check, all_versions=True)
        else:
            infos = [info_row(store, step, args.check) for step in store.steps()]
        rows_of += [(tier, store, i) for i in infos]
    rows_of.sort(key=lambda r: r[2].step)  # stable: the durable tier first at one step
    show_tier = len(tiers) > 1
    if args.json:
        print(jsonio.dumps([json_safe({**i.to_json(), **({"tier": t} if show_tier else {})})
                            for t, _, i in rows_of], indent=1).decode())
        return 0
    if not rows_of:
        print(f"no checkpoints under {' or '.join(s.storage.url for _, s in tiers)}")
        return 0
    rows = [(*(("TIER",) if show_tier else ()), "STEP", "ID", "STATUS", "SIZE", "CREATED",
             "LOSS", "NOTE")]
    for tier, store, i in rows_of:
        rows.append((*((tier,) if show_tier else ()), str(i.step), i.id or "-", i.status,
                     fmt_bytes(i.bytes), fmt_time(i.created),
                     fmt_loss((i.user_metadata or {}).get("loss")),
                     " ".join((i.problem or "").replace(store.storage.url + "/", "").split())))
    for line in format_table(rows, terminal_width()):
        print(line)
    return 0


def cmd_verify(args) -> int:
    store = open_store(args)
    if args.id is not None:
        entry = store.life.find(args.id)
        if entry.manifest is None:
            print(f"id {args.id} (step {entry.step}): {entry.status}: {entry.problem}")
            return 1
        progress = Progress(f"id {args.id}", args.progress or sys.stderr.isatty())
        try:
            store.verify_manifest(entry.manifest, full=not args.size_only, progress=progress)
        except CheckpointError as exc:
            print(f"id {args.id} (step {entry.step}, {entry.status}): CORRUPT: {exc}")
            return 1
        print(f"id {args.id} (step {entry.step}, {entry.status}): ok "
              f"({len(entry.manifest.files)} files, {fmt_bytes(entry.manifest.total_bytes)})")
        return 0
    steps = [args.step] if args.step is not None else store.committed_steps()
    if not steps:
        print(f"no committed checkpoints under {args.url}", file=sys.stderr)
        return 1
    bad = 0
    for step in steps:
        progress = Progress(f"step {step}", args.progress or sys.stderr.isatty())
        try:
            m = store.verify(step, full=not args.size_only, progress=progress)
            print(f"step {step}: ok ({len(m.files)} files, {fmt_bytes(m.total_bytes)})")
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

    store = open_store(args)
    info = inspect.show(store, _select(store, step=args.step, save_id=args.id),
                        with_tensors=args.tensors)
    if args.json:
        print(jsonio.dumps(json_safe(info), indent=1).decode())
        return 0
    layout = info["layout"] or {}
    shown = " ".join(f"{k}={v}" for k, v in layout.items() if k != "world_size")
    meta = {k: v for k, v in (info["user_metadata"] or {}).items() if k != "config"}
    w = info["writer"] or {}
    lines = [
        ("url", info["url"]),
        ("created", fmt_time(info["created_unix"])),
        ("layout", f"{shown or '-'} (world size {info['world_size']})"),
        ("tensors", f"{info['num_tensors']} ({fmt_bytes(info['tensor_bytes'])}); "
                    f"{info['num_objects']} other values"),
        ("files", f"{info['num_files']} ({fmt_bytes(info['total_bytes'])})"),
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

    store = open_store(args)
    try:
        a, b = _select(store, args.a), _select(store, args.b)
        progress = Progress("diff", args.progress or sys.stderr.isatty())
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
            for line in format_table(rows, terminal_width()):
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


def cmd_history(args) -> int:
    from ckpt import inspect

    if not (math.isfinite(args.mtbf_hours) and args.mtbf_hours > 0):
        raise UsageError(f"--mtbf-hours {args.mtbf_hours}: pass the prior MTBF in hours, > 0 "
                         f"(the job's checkpoint.mtbf_hours)")
    store = open_store(args)
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
            print(f"    {fmt_time(f['unix'])}")
        print(f"  uptime       {fmt_seconds(info['uptime_seconds'])}")
        print(f"  MTBF         {fmt_seconds(info['mtbf_seconds'])} used by the auto cadence "
              f"(prior {fmt_seconds(info['mtbf_prior_seconds'])} with weight "
              f"{info['prior_weight']:g}; observed "
              f"{fmt_seconds(info['mtbf_observed_seconds'])})")
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
              f"{fmt_time(lease.get('heartbeat_unix'))}")
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
    progress = Progress("export", args.progress or sys.stderr.isatty())
    m = export(open_store(args).storage, args.step, args.out, select=args.select,
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
    sp.add_argument("--local", action="append", metavar="LOCAL_ROOT",
                    help="also list this local tier (checkpoint.local_root of a node), with "
                         "a TIER column; repeat for several nodes' roots")
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
