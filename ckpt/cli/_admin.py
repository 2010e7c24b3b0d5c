"""The ``ckpt`` commands that change a root: pin/unpin, rollback, restore, gc.

Each holds the root's write lease for its duration (:func:`ckpt.cli._common.writer`), under
the rules every writer follows.
"""

from __future__ import annotations

import sys
import time

from ckpt.cli._lineage import branch_of
from ckpt.cli._common import (
    Progress,
    UsageError,
    fmt_bytes,
    open_storage,
    open_store,
    printable,
    writer,
)
from ckpt.errors import CheckpointError, CorruptCheckpointError, LeaseHeldError
from ckpt.format import jsonio
from ckpt.job import read_pins, set_pinned
from ckpt.root import ROLLED_BACK, CheckpointStore, Lease, Lifecycle

__all__ = ["cmd_pin", "cmd_rollback", "cmd_restore", "cmd_gc"]


def cmd_pin(args, pinned: bool) -> int:
    """Pin after a full verification (a pin keeps a checkpoint for good: it must be one
    worth keeping), or anyway with ``--force``. Unpin needs no readable checkpoint."""

    store = open_store(args)
    try:
        pins = read_pins(store, strict=True)  # a damaged pins.json is never overwritten
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if pinned and not args.force:
        progress = Progress(f"verifying step {args.step}", sys.stderr.isatty())
        try:
            store.verify(args.step, full=True, progress=progress)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"refusing to pin step {args.step}: {exc} (pass --force to pin it anyway)",
                path=exc.path) from exc
    elif pinned or args.step not in pins:
        try:
            store.read_manifest(args.step)  # must exist
        except CorruptCheckpointError:
            pass  # --force, or unpin: a damaged manifest is no reason to refuse
    with writer(args, "pin" if pinned else "unpin"):
        try:
            pins = set_pinned(store, args.step, pinned)
        except CheckpointError:
            raise
        except ValueError as exc:  # pins.json damaged meanwhile
            raise UsageError(str(exc)) from None
    print(f"pinned steps: {sorted(pins) or 'none'}")
    return 0


def cmd_rollback(args) -> int:
    with writer(args, "rollback", force=args.force) as life:
        store = CheckpointStore(life.storage, lifecycle=life)
        store.verify(args.step, full=True)
        branch = branch_of(store, [s for s in store.committed_steps() if s > args.step])
        for s, kept, exc in life.uncommit_newer(args.step):
            if exc is not None:
                print(f"step {s}: not a valid checkpoint, left as it is ({exc})")
                continue
            print(f"step {s}: rolled back (id {kept}; `ckpt restore {args.url} --id {kept}` "
                  f"re-commits it)")
    if branch:
        print(f"abandons the branch: {branch} (`ckpt history {args.url}` shows the tree)")
    print(f"step {args.step} is now the latest checkpoint; a resumed job starts from it")
    return 0


def cmd_restore(args) -> int:
    with writer(args, "restore", force=args.force) as life:
        try:
            m = life.restore(args.id, replace=args.replace)
        except FileExistsError as exc:  # committed already, or its step is taken
            raise UsageError(str(exc)) from None
    print(f"step {m.step}: restored id {m.save_id}; it is committed again")
    return 0


def cmd_gc(args) -> int:
    """Remove dead attempts' files (and rolled-back checkpoints, or manifests that cannot be
    read with their files, when asked). Dry run unless ``--yes``; either way the root's lease
    is respected. A step holding a manifest that cannot be read is reported as kept (it is
    someone's committed data); only ``--damaged`` removes it, never one of a newer ckpt."""

    older = args.older_than or 0.0

    def plan(life) -> tuple[list, list, list, list]:
        rolled = []
        if args.rolled_back:
            now = time.time()
            for step in life.steps():
                for e in life.entries(step):
                    if e.status == ROLLED_BACK and e.manifest is not None and \
                            now - e.manifest.created_unix >= older:
                        rolled.append(e)
        damaged = life.damaged() if args.damaged else []
        cleared = {step for step, _, _ in damaged}
        kept = [(step, why) for step, why in life.kept() if step not in cleared]
        return life.leftovers(), rolled, damaged, kept

    def show(leftovers, rolled, damaged, kept, verb: str) -> None:
        if args.json:
            print(jsonio.dumps({
                "dry_run": not args.yes,
                "leftovers": [{"step": step, "files": names} for step, names in leftovers],
                "rolled_back": [{"step": e.step, "id": e.id,
                                 "bytes": e.manifest.total_bytes} for e in rolled],
                "damaged": [{"step": step, "manifests": manifests, "files": files}
                            for step, manifests, files in damaged],
                "kept": [{"step": step, "why": why} for step, why in kept]},
                indent=1).decode())
            return
        for step, names in leftovers:
            print(f"step {step}: {verb} {len(names)} leftover file(s) of aborted saves")
        for e in rolled:
            print(f"step {e.step}: {verb} rolled-back checkpoint id {printable(e.id)} "
                  f"({fmt_bytes(e.manifest.total_bytes)})")
        for step, manifests, files in damaged:
            print(f"step {step}: {verb} {printable(', '.join(manifests))} (cannot be read) and "
                  f"{len(files)} file(s) no readable manifest references")
        for step, why in kept:
            print(f"step {step}: {printable(why)}")
        if not leftovers and not rolled and not damaged:
            print("nothing to remove")

    if not args.yes:
        storage = open_storage(args)
        info, _ = Lease(storage).read()
        if info is not None and Lease(storage).expired_because(info) is None:
            raise LeaseHeldError(f"{args.url} is being written by job {info.get('job')!r} "
                                 f"(host {info.get('host')}, pid {info.get('pid')}): its save "
                                 f"in flight would look like leftovers. Run gc when it stops.")
        planned = plan(Lifecycle(storage))
        show(*planned, "would remove")
        if any(planned[:3]) and not args.json:
            print("dry run: nothing removed; pass --yes to remove these")
        return 0
    with writer(args, "gc", force=args.force) as life:
        leftovers, rolled, damaged, kept = plan(life)
        for step, _, _ in damaged:
            life.remove_damaged(step)
        life.cleanup()
        for e in rolled:
            life.delete_entry(e)
        show(leftovers, rolled, damaged, kept, "removed")
    return 0
