"""The ``ckpt`` commands that read a root: list, verify, show, diff, history, export.

Each takes the parsed arguments (:func:`ckpt.cli._main.build_parser`) and returns the exit status;
errors propagate to :func:`ckpt.cli.main`, which prints them as one line.

Size: the read-only commands (list, show, verify) share their output formats and their one
way of opening a root.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from ckpt.cadence import GOODPUT_CATEGORIES, load_goodput
from ckpt.cli import _inspection
from ckpt.cli._lineage import print_trajectories, trajectories
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
    printable,
    terminal_width,
    with_unit,
)
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedCheckpointError,
    error_line,
)
from ckpt.export import check_out_dir, check_out_file, export, parse_dtype, select_keys
from ckpt.format import data_file_id, jsonio, step_dirname
from ckpt.job import read_pins, read_retention
from ckpt.root import (
    COMMITTED,
    CORRUPT,
    FENCED,
    INCOMPLETE,
    CheckpointInfo,
    CheckpointStore,
    Lease,
)
from ckpt.units import parse_size

__all__ = ["cmd_list", "cmd_verify", "cmd_show", "cmd_diff", "cmd_history", "cmd_export"]


LEFTOVER = "leftover"
"""``ckpt list --all``'s status of files of aborted saves that no listed version owns."""


def _warn(args, message: str) -> None:
    print(f"ckpt {args.command}: {' '.join(str(message).split())}", file=sys.stderr)


def _counts(info: CheckpointInfo) -> bool:
    """Whether ``info`` is a step's committed version (verified or found corrupt by the
    check): the one retention keeps or deletes, and a pin protects."""
    return info.status == COMMITTED or (info.status == CORRUPT and info.save_id is not None)


def _kept_for(args, store: CheckpointStore, infos: list[CheckpointInfo]) -> dict[int, list[str]]:
    """Why retention keeps each committed step, beyond the newest: ``pinned`` (``ckpt pin``),
    and each best-k policy the writing job recorded (``KeepBest``)."""
    reasons: dict[int, list[str]] = {}
    counted = [i for i in infos if _counts(i)]
    try:
        pins = read_pins(store, strict=True)
    except ValueError as exc:
        _warn(args, f"{exc}; pins not shown")
        pins = set()
    try:
        best = read_retention(store)
    except ValueError as exc:
        _warn(args, f"{exc}; the best-k reasons are not shown")
        best = []
    for i in counted:
        if i.step in pins:
            reasons.setdefault(i.step, []).append("pinned")
    steps = sorted({i.step for i in counted})
    for policy in best:
        for i in counted:
            policy.note(i.step, i.user_metadata)
        for step in sorted(policy.keep(steps)):
            reasons.setdefault(step, []).append(policy.reason())
    return reasons


def _live_writer(store: CheckpointStore) -> bool:
    """Whether a live job holds the root's write lease (its save in flight has no manifest
    yet either)."""
    lease = Lease(store.storage)
    info, _ = lease.read()
    return info is not None and lease.expired_because(info) is None


def _leftovers(store: CheckpointStore, infos: list[CheckpointInfo]
               ) -> list[tuple[CheckpointInfo, dict[str, Any]]]:
    """``--all``: what ``ckpt gc`` would remove, shown. An attempt listed by its marker
    (incomplete) or its fenced manifest says so in its note; files no listed version owns
    become a ``leftover`` row per step (size, names)."""
    live = _live_writer(store)
    rows = []
    for step, names in store.life.leftovers():
        covered: set[str] = set()
        for e in store.life.entries(step):
            listed = [i for i in infos if i.step == step and i.save_id == e.id
                      and i.status == e.status and e.status in (INCOMPLETE, FENCED)]
            if e.id is None or not listed:
                continue
            files = {n for n in names if data_file_id(n) == e.id or n == e.name}
            covered |= files
            i = listed[0]
            if i.status == INCOMPLETE:
                i.problem = ("no manifest: a save in flight, or an aborted one (a live job "
                             "holds the lease)" if live else
                             f"no manifest: an aborted save; `ckpt gc` removes its "
                             f"{len(files)} file(s)")
            else:
                i.problem = f"{i.problem}; `ckpt gc` removes it"
        rest = [n for n in names if n not in covered]
        if not rest:
            continue
        folder = step_dirname(step)
        sizes = {n: size for n, kind, size in store.storage.listdir(folder) if kind == "file"}
        shown = ", ".join(rest[:3]) + (", ..." if len(rest) > 3 else "")
        what = ("of a save in flight or of aborted ones (a live job holds the lease)" if live
                else "of aborted saves")
        rows.append((CheckpointInfo(
            step, LEFTOVER, store.storage.describe(folder), sum(sizes.get(n, 0) for n in rest),
            problem=f"{len(rest)} file(s) {what} ({shown})" +
                    ("" if live else "; `ckpt gc` removes them")), {"files": rest}))
    return rows


def cmd_list(args) -> int:
    """Exit 1 when a listed checkpoint is corrupt (found so by ``--check``, or a manifest
    that cannot be read), else 0."""
    tiers = [("durable", open_store(args))]
    for local in args.local or ():
        if local.rstrip("/") == args.url.rstrip("/"):
            raise UsageError(f"--local {local} is the durable root itself; pass the local "
                             f"tier's folder (checkpoint.local_root)")
        tiers.append((f"local:{local}" if len(args.local) > 1 else "local",
                      open_store(argparse.Namespace(**{**vars(args), "url": local}))))
    rows_of: list[tuple[str, CheckpointStore, CheckpointInfo, dict[str, Any]]] = []
    for tier, store in tiers:
        if args.all:
            infos = store.list(check=args.check, all_versions=True)
        else:
            infos = [info_row(store, step, args.check) for step in store.steps()]
        kept = _kept_for(args, store, infos)
        rows = [(i, {"pinned": _counts(i) and "pinned" in kept.get(i.step, ()),
                     "kept_for": kept.get(i.step, []) if _counts(i) else []}) for i in infos]
        if args.all:
            rows += _leftovers(store, infos)
        rows_of += [(tier, store, i, extra) for i, extra in rows]
    rows_of.sort(key=lambda r: r[2].step)  # stable: the durable tier first at one step
    show_tier = len(tiers) > 1
    corrupt = any(i.status == CORRUPT for _, _, i, _ in rows_of)
    if args.json:
        print(jsonio.dumps([json_safe({**i.to_json(), **extra,
                                       **({"tier": t} if show_tier else {})})
                            for t, _, i, extra in rows_of], indent=1).decode())
        return 1 if corrupt else 0
    if not rows_of:
        print(f"no checkpoints under {' or '.join(s.storage.url for _, s in tiers)}")
        return 0
    rows = [(*(("TIER",) if show_tier else ()), "STEP", "ID", "STATUS", "SIZE", "CREATED",
             "LOSS", "NOTE")]
    for tier, store, i, extra in rows_of:
        problem = " ".join((i.problem or "").replace(store.storage.url + "/", "").split())
        note = "; ".join([*extra.get("kept_for", []), *([problem] if problem else [])])
        rows.append((*((tier,) if show_tier else ()), str(i.step), i.id or "-", i.status,
                     fmt_bytes(i.bytes), fmt_time(i.created),
                     fmt_loss((i.user_metadata or {}).get("loss")), note))
    for line in format_table(rows, terminal_width()):
        print(line)
    return 1 if corrupt else 0


def _share(m) -> str:
    """``; node 0's share of ...`` for a version that holds one node's share of a job-wide
    checkpoint (its ``span``: a node-local version), else nothing."""
    return f"; {m.span.describe()}" if m.span is not None else ""


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
              f"({len(entry.manifest.files)} files, {fmt_bytes(entry.manifest.total_bytes)}"
              f"{_share(entry.manifest)})")
        return 0
    steps = [args.step] if args.step is not None else store.committed_steps()
    if not steps:
        print(f"no committed checkpoints under {args.url}", file=sys.stderr)
        return 1
    bad = fenced = 0
    for step in steps:
        progress = Progress(f"step {step}", args.progress or sys.stderr.isatty())
        try:
            m = store.verify(step, full=not args.size_only, progress=progress)
            print(f"step {step}: ok ({len(m.files)} files, {fmt_bytes(m.total_bytes)}"
                  f"{_share(m)})")
        except FencedCheckpointError as exc:
            # A writer's manifest after it lost the lease: never read, so no damage to the
            # root, only a leftover (unless it is the step asked for).
            fenced += 1
            bad += args.step is not None
            print(f"step {step}: fenced leftover, not a checkpoint: {exc}")
        except CheckpointNotFoundError:
            bad += 1
            print(f"step {step}: no checkpoint at step {step} "
                  f"({store.storage.describe(step_dirname(step))} holds no committed "
                  f"manifest); `ckpt list {args.url} --all` shows what exists")
        except CorruptCheckpointError as exc:
            bad += 1
            print(f"step {step}: CORRUPT: {exc}")
    if fenced == len(steps) and args.step is None:
        print(f"no committed checkpoints under {args.url} (only fenced leftovers)",
              file=sys.stderr)
        return 1
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
    return _inspection.select(store, step, save_id)


def cmd_show(args) -> int:
    store = open_store(args)
    info = _inspection.show(store, _select(store, step=args.step, save_id=args.id),
                        with_tensors=args.tensors)
    try:
        pins = read_pins(store, strict=True)
    except ValueError as exc:
        _warn(args, f"{exc}; whether the step is pinned is not known")
        pins = set()
    info["pinned"] = info["status"] == COMMITTED and info["step"] in pins
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
        ("writer", f"job {w.get('job', '-')!r} (owner {w.get('owner', '-')}, lease "
                   f"generation {w.get('lease_generation', '-')})"),
        ("pinned", "yes (`ckpt unpin` lets retention delete it)" if info["pinned"] else "no"),
        ("versions", ", ".join(f"{k} {v}" for k, v in (info["versions"] or {}).items()) or "-"),
        ("metadata", ", ".join(f"{k}={jsonio.dumps(v).decode()}" for k, v in meta.items())
         or "-"),
    ]
    if info["share"]:  # one node's share of a job-wide checkpoint (a node-local version)
        lines.insert(3, ("share", f"{info['share']}: loads only on that layout, never "
                                  f"exported"))
    config = (info["user_metadata"] or {}).get("config")
    if isinstance(config, dict):
        lines.append(("config", f"stored ({len(config)} sections; --json shows it)"))
    print(printable(f"step {info['step']}  id {info['id']}  {info['status']}"))
    for k, v in lines:
        print(f"  {k:<12} {printable(v)}")
    if args.tensors:
        rows = [("KEY", "SHAPE", "DTYPE", "BYTES")]
        rows += [(k, "x".join(map(str, t["shape"])) or "scalar", t["dtype"], str(t["bytes"]))
                 for k, t in info["tensors"].items()]
        for line in format_table(rows, None):  # key names escaped (format_table)
            print("  " + line)
    return 0


def cmd_diff(args) -> int:
    """Exit 0 when the two checkpoints hold the same values, 1 when they differ, 2 when
    they could not be compared (missing or corrupt, a tensor over --max-tensor-bytes, bad
    input): as with diff(1), 1 means "different" only."""

    store = open_store(args)
    try:
        a, b = _select(store, args.a), _select(store, args.b)
        progress = Progress("diff", args.progress or sys.stderr.isatty())
        result = _inspection.diff(store, a, b, max_tensor_bytes=args.max_tensor_bytes,
                              progress=progress)
    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
        raise UsageError(error_line(exc, (UsageError,))) from exc
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
        info = _inspection.history(store, mtbf_prior_seconds=args.mtbf_hours * 3600.0)
    except CheckpointError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        ledger = load_goodput(store.storage)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    info["goodput"] = ledger.breakdown() if ledger is not None else None
    info["trajectories"] = trajectories(store)
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
    _print_goodput(info["goodput"])
    print_trajectories(info["trajectories"])
    return 0


def _print_goodput(goodput: dict[str, Any] | None) -> None:
    """Where the job's wall time went (its goodput record, as the monitoring exports it)."""
    if goodput is None:
        print("  goodput      no record (no trainer has written one here yet)")
        return
    wall = goodput["wall_seconds"]
    share = f"{100 * goodput['goodput']:.1f}%" if goodput["goodput"] is not None else "-"
    print(f"  goodput      {share} of {fmt_seconds(wall)} since the job first started "
          f"({fmt_time(goodput['first_start_unix'])}; recorded "
          f"{fmt_time(goodput['recorded_unix'])})")
    for category in GOODPUT_CATEGORIES:
        seconds = goodput["seconds"][category]
        print(f"    {category.replace('_', ' '):<18} {fmt_seconds(seconds):>7} "
              f"{100 * seconds / wall if wall > 0 else 0.0:5.1f}%")


def cmd_export(args) -> int:
    if args.out is None and args.attachments is None:
        raise UsageError("give --out FILE (or a folder with --format hf), --attachments DIR, "
                         "or both")
    if args.format != "hf" and args.max_shard_size is not None:
        raise UsageError("--max-shard-size applies to --format hf only")
    if args.format != "hf" and args.no_config:
        raise UsageError("--no-config applies to --format hf only")
    try:  # before reading any checkpoint data
        with_unit(parse_size, "GB")(args.max_shard_size or "5GB")
    except ValueError as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    try:
        if args.dtype is not None:
            parse_dtype(args.dtype)
        if args.out is not None and args.format == "hf":
            check_out_dir(args.out, force=args.force)
        elif args.out is not None:
            check_out_file(args.out)
    except (ValueError, FileExistsError) as exc:
        raise UsageError(str(exc)) from None
    progress = Progress("export", args.progress or sys.stderr.isatty())
    store = open_store(args)
    try:
        m = export(store.storage, args.step, args.out, select=args.select,
                   progress=progress if args.out is not None else None, dtype=args.dtype,
                   format=args.format, max_shard_size=args.max_shard_size or "5GB",
                   force=args.force, attachments_dir=args.attachments,
                   no_config=args.no_config)
    except CheckpointError:
        raise
    except (ValueError, FileExistsError) as exc:  # --select, --dtype, names, files in the way
        raise UsageError(str(exc)) from None
    if args.out is not None:
        kept = select_keys([*m.tensors, *m.objects], args.select).values() if args.select \
            else m.tensors
        of = f" of {len(m.tensors)}" if args.select else ""
        print(f"exported step {m.step}: {sum(k in m.tensors for k in kept)}{of} tensors, "
              f"{fmt_bytes(_size(args.out))} written to {args.out}")
    if args.attachments is not None:
        names = ", ".join(sorted(m.attachments)) or "none"
        print(f"wrote {len(m.attachments)} attachment(s) of step {m.step} to "
              f"{args.attachments}: {printable(names)}")
    return 0


def _size(path: str) -> int:
    """Bytes of a file, or of the files in a folder (an hf export)."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if os.path.isfile(os.path.join(path, n)))
