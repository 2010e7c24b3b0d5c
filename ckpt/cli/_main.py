"""ckpt: the operator's view of a checkpoint root.

    ckpt list URL [--all] [--json] [--check none|size|full]
    ckpt verify URL [--step N | --id ID] [--size-only] [--progress]
    ckpt show URL [--step N | --id ID] [--tensors] [--json]
                                    (what a checkpoint holds, who wrote it, its metadata)
    ckpt diff URL A B [--json]      (A, B: steps or ids; tensor by tensor; exit 0 when
                                     identical, 1 when they differ, 2 on trouble: a
                                     missing or corrupt checkpoint too)
    ckpt history URL [--json]       (the job's failures, the MTBF `auto` uses, the lease, the
                                    trajectories: a tree of runs, live and abandoned versions)
    ckpt export URL [--step N] --out FILE(.pt|.safetensors) [--select PREFIX ...]
                    [--dtype bf16] [--attachments DIR]
    ckpt export URL [--step N] --format hf --out DIR [--select PREFIX] [--dtype bf16]
                    [--max-shard-size 5GB] [--force] [--no-config]
                                    (a Hugging Face folder: sharded safetensors, index and the
                                     checkpoint's attachments; refused without a config.json
                                     attachment unless --no-config)
    ckpt pin URL --step N [--force] / ckpt unpin URL --step N
                                    (pin verifies every checksum first; --force pins a
                                     damaged checkpoint anyway)
    ckpt rollback URL --step N [--force]
                                    (un-commit newer checkpoints; reversible, deletes nothing;
                                     refused while a live job holds the write lease)
    ckpt restore URL --id ID [--replace]   (re-commit a rolled-back checkpoint)
    ckpt gc URL [--rolled-back [--older-than 7d]] [--damaged] [--yes]
                                    (remove aborted saves' leftovers; dry run by default)
    ckpt plan ...                   (checkpoint interval from size, bandwidth, MTBF)

This module builds the parser and runs one command; the command bodies live in
:mod:`ckpt.cli._read` (reading) and :mod:`ckpt.cli._admin` (changing a root), ``plan`` in
:mod:`ckpt.cli._plan`, the one-line error format in :func:`ckpt.errors.error_line`.

S3 endpoints and credentials come from the usual AWS environment variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) or --endpoint-url. A request the storage
throttles (503 SlowDown) is retried for --retry-for (default 2m), one that gets no answer
for at most 30s; a first request that takes more than 2s is announced on stderr.

Exit status, the same for every command:
  0   ok (diff: the two checkpoints are identical)
  1   a checkpoint is corrupt or missing: a step or id that does not exist, a checksum or
      size that does not match, a manifest that cannot be read (list: one it lists as
      corrupt; verify: one that fails; diff: the two differ)
  2   anything else: bad usage or input (a root that does not exist, a missing S3 bucket,
      an --out that is in the way), the root held by a live job, storage unreachable or
      throttled past --retry-for (diff: trouble, a missing or corrupt checkpoint included)
  130 interrupted (Ctrl-C)
Every error is one line on stderr naming what is wrong and how to fix it; --debug
(anywhere on the command line) adds the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from typing import Sequence

from ckpt.cli._admin import cmd_gc, cmd_pin, cmd_restore, cmd_rollback
from ckpt.cli._common import UsageError, arg_type, parse_step
from ckpt.cli._plan import add_cadence_plan_arguments, run_cadence_plan
from ckpt.cli._read import cmd_diff, cmd_export, cmd_history, cmd_list, cmd_show, cmd_verify
from ckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    OneLineArgumentParser,
    error_line,
)
from ckpt.units import parse_duration

__all__ = ["main", "build_parser"]


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
            sp.add_argument("--retry-for", type=arg_type(parse_duration), metavar="DURATION",
                            help="how long to retry a storage request that is throttled "
                                 "(503 SlowDown), e.g. 30s, 10m (default: 2m; unanswered "
                                 "requests: at most 30s)")
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
    sp.add_argument("--step", type=arg_type(parse_step),
                    help="verify this step's committed checkpoint (default: every committed one)")
    sp.add_argument("--id", help="verify one version by id (e.g. a rolled-back one)")
    sp.add_argument("--size-only", action="store_true", help="check sizes, not checksums")
    sp.add_argument("--progress", action="store_true", help="show progress even when piped")
    sp.set_defaults(fn=cmd_verify)
    sp = add("show", "what one checkpoint holds: layout, tensors, sizes, metadata, writer")
    sp.add_argument("--step", type=arg_type(parse_step), help="default: the newest committed")
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
    sp = add("history", "the job's failure history, the MTBF the auto cadence uses, the lease, "
                        "and the trajectories (each run, where it resumed from, what is live)")
    sp.add_argument("--mtbf-hours", type=float, default=24.0,
                    help="the prior MTBF, as the job's checkpoint.mtbf_hours (default: 24)")
    sp.add_argument("--json", action="store_true", help="print a JSON object")
    sp.set_defaults(fn=cmd_history)
    sp = add("export", "consolidate a checkpoint into one .pt or .safetensors file, or a "
                       "Hugging Face folder")
    sp.add_argument("--step", type=arg_type(parse_step), help="default: the newest committed")
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
    sp.add_argument("--no-config", action="store_true",
                    help="with --format hf: export a checkpoint without a config.json "
                         "attachment (the weights alone; from_pretrained needs a config)")
    sp.add_argument("--progress", action="store_true", help="show progress even when piped")
    sp.set_defaults(fn=cmd_export)
    sp = add("pin", "protect a checkpoint from retention (after a full checksum pass)")
    sp.add_argument("--step", type=arg_type(parse_step), required=True, help="the step to pin")
    sp.add_argument("--force", action="store_true",
                    help="pin even if the checkpoint fails verification")
    sp.set_defaults(fn=lambda a: cmd_pin(a, True))
    sp = add("unpin", "remove a pin")
    sp.add_argument("--step", type=arg_type(parse_step), required=True, help="the step to unpin")
    sp.set_defaults(fn=lambda a: cmd_pin(a, False))
    sp = add("rollback", "make STEP the latest: un-commit newer checkpoints (reversible)")
    sp.add_argument("--step", type=arg_type(parse_step), required=True,
                    help="the step to resume from (verified first); newer ones are "
                         "un-committed")
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
    sp.add_argument("--older-than", metavar="DURATION", type=arg_type(parse_duration),
                    help="with --rolled-back: only those created longer ago (e.g. 7d, 12h)")
    sp.add_argument("--damaged", action="store_true",
                    help="also remove manifests that cannot be read (damaged; never one of a "
                         "newer ckpt) and the files only they may reference: run `ckpt "
                         "verify` first")
    sp.add_argument("--yes", action="store_true", help="remove (default: dry run)")
    sp.add_argument("--force", action="store_true",
                    help="take the write lease from a live job (its later saves stop counting)")
    sp.add_argument("--json", action="store_true", help="print a JSON object")
    sp.set_defaults(fn=cmd_gc)
    sp = add("plan", "recommend a checkpoint interval")
    add_cadence_plan_arguments(sp)
    sp.set_defaults(fn=run_cadence_plan)
    return p


class _Warnings(logging.Handler):
    """The store's warnings while a command runs, one line each after the command's name;
    storage retries at most one line per ``RETRY_LINE_SECONDS`` (a throttled bucket
    retries often), with the count of those not shown."""

    RETRY_LINE_SECONDS = 5.0

    def __init__(self, prog: str):
        super().__init__(logging.WARNING)
        self.prog = prog
        self.last_retry = -float("inf")
        self.hidden = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = " ".join(record.getMessage().split())
        except Exception:  # noqa: BLE001 - a bad log call must not end the command
            return
        if record.name == "ckpt.storage":  # RetryPolicy: one record per retry
            now = time.monotonic()
            if now - self.last_retry < self.RETRY_LINE_SECONDS:
                self.hidden += 1
                return
            self.last_retry = now
            if self.hidden:
                text += f" ({self.hidden} more retries not shown)"
                self.hidden = 0
        sys.stderr.write(f"{self.prog}: {text}\n")
        sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and an exit status (see the
    module docstring): 1 for a corrupt or missing checkpoint, 2 for anything else."""
    args = build_parser().parse_args(argv)
    prog = f"ckpt {args.command}"
    warnings = _Warnings(prog)
    logging.getLogger("ckpt").addHandler(warnings)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place errors become exit statuses
        if args.debug:
            traceback.print_exc()
        print(f"{prog}: {error_line(exc, (UsageError,))}", file=sys.stderr)
        return 1 if isinstance(exc, (CorruptCheckpointError, CheckpointNotFoundError)) else 2
    finally:
        logging.getLogger("ckpt").removeHandler(warnings)


if __name__ == "__main__":
    sys.exit(main())
