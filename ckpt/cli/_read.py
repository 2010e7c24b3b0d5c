"""The ``ckpt`` commands that read a root: list, verify, show, diff, history, export.

Each takes the parsed arguments (:func:`ckpt.cli.build_parser`) and returns the exit status;
errors propagate to :func:`ckpt.cli.main`, which prints them as one line.
"""

from __future__ import annotations

import argparse
import math
import sys

from ckpt.cli import inspection
from ckpt.cli._common import (
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
from ckpt.cli._errors import error_line
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from ckpt.export import check_out_dir, check_out_file, export, parse_dtype
from ckpt.format import jsonio
from ckpt.root import CheckpointStore
from ckpt.units import parse_size

__all__ = ["cmd_list", "cmd_verify", "cmd_show", "cmd_diff", "cmd_history", "cmd_export"]


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
    return inspection.select(store, step, save_id)


def cmd_show(args) -> int:
    store = open_store(args)
    info = inspection.show(store, _select(store, step=args.step, save_id=args.id),
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

    store = open_store(args)
    try:
        a, b = _select(store, args.a), _select(store, args.b)
        progress = Progress("diff", args.progress or sys.stderr.isatty())
        result = inspection.diff(store, a, b, max_tensor_bytes=args.max_tensor_bytes,
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
    if not (math.isfinite(args.mtbf_hours) and args.mtbf_hours > 0):
        raise UsageError(f"--mtbf-hours {args.mtbf_hours}: pass the prior MTBF in hours, > 0 "
                         f"(the job's checkpoint.mtbf_hours)")
    store = open_store(args)
    try:
        info = inspection.history(store, mtbf_prior_seconds=args.mtbf_hours * 3600.0)
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
    if args.out is None and args.attachments is None:
        raise UsageError("give --out FILE (or a folder with --format hf), --attachments DIR, "
                         "or both")
    if args.format != "hf" and args.max_shard_size is not None:
        raise UsageError("--max-shard-size applies to --format hf only")
    if args.format != "hf" and args.no_config:
        raise UsageError("--no-config applies to --format hf only")
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
               force=args.force, attachments_dir=args.attachments, no_config=args.no_config)
    if args.out is not None:
        kept = f"{len(args.select)} prefix(es) selected from " if args.select else ""
        print(f"exported step {m.step} ({kept}{len(m.tensors)} tensors) to {args.out}")
    if args.attachments is not None:
        names = ", ".join(sorted(m.attachments)) or "none"
        print(f"wrote {len(m.attachments)} attachment(s) of step {m.step} to "
              f"{args.attachments}: {names}")
    return 0
