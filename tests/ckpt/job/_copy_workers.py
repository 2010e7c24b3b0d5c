"""Bodies of the tests of local copies on the next node (module-level: run_ranks pickles them
by name). Each rank is a node of its own: a tiny model and optimizer of its own, trained on
data drawn from (step, rank) alone, so a resumed run can be compared bit for bit with one
that never stopped."""

from __future__ import annotations

import os
import signal

import torch

LOCAL_EVERY, DURABLE_EVERY = "2", "4"


def _model(rank: int):
    from tests.ckpt._mgr_workers import _mlp

    torch.manual_seed(7 + rank)
    model = _mlp()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(rank: int, model, opt, step: int) -> dict:
    from ckpt.dcp import ModelState

    return {f"node{rank}": ModelState(model, opt), "progress": {"step": step}}


def _mgr(root: str, local_root: str, node: int, durable: str = DURABLE_EVERY):
    from ckpt.job import LocalTierOptions, ManagerOptions, TieredCheckpointManager

    return TieredCheckpointManager(root, local_root,
                                   ManagerOptions(busy="wait", lease_ttl_seconds=5.0),
                                   local=LocalTierOptions(node_rank=node, copies=2),
                                   cadence=durable, local_cadence=LOCAL_EVERY)


def _steps(mgr, rank: int, model, opt, first: int, last: int) -> None:
    """Train ``first``..``last``, saving as the cadences say; every copy is waited for, so
    that each local step is on two nodes before the next one (no copy skipped)."""
    from tests.ckpt._mgr_workers import _train

    for step in range(first, last + 1):
        _train([(model, opt)], rank, step)
        if mgr.maybe_save(step, _state(rank, model, opt, step)):
            mgr.wait()


def _kinds(mgr, *kinds: str) -> dict:
    return {k: [(e.step, {f: v for f, v in e.fields.items() if f in ("peer_node", "node",
                                                                      "reason", "tier")})
                for e in mgr.events.of_kind(k)] for k in kinds}


def train_body(rank: int, world: int, root: str, local_root: str, last: int,
               durable: str = DURABLE_EVERY, die_copying: tuple[int, int] | None = None,
               per_node: int = 1) -> dict:
    """Train 1..``last`` on every node with copies on the next node, and stop as a crash
    does (no ``close``: leases left behind, nothing flushed). ``die_copying=(node, step)``:
    that node's process kills itself (SIGKILL) while it writes the copy of ``step`` it
    receives, after its first data file and before the copy's manifest. ``per_node``:
    ranks per node (node = rank // per_node)."""
    if die_copying is not None and rank == die_copying[0]:
        _die_while_copying(die_copying[1])
    from monitoring import Metrics

    model, opt = _model(rank)
    mgr = _mgr(root, local_root, rank // per_node, durable)
    metrics = Metrics(mgr.events, rank=rank)
    _steps(mgr, rank, model, opt, 1, last)
    series = {(s.name, s.labels.get("outcome")): s.value
              for fam in metrics.registry.collect() for s in fam.samples
              if s.name.startswith(("ckpt_peer_copies", "ckpt_peer_copied", "ckpt_peer_copy"))}
    return {**_kinds(mgr, "copy_committed", "copy_failed", "copy_skipped"),
            "metrics": series}


def _die_while_copying(step: int) -> None:
    """Die (SIGKILL) once the first chunk of a data file of ``step``'s copy is written, its
    file not yet synced or closed: a copy torn in the middle of a file."""
    from ckpt.format import data_file_id, step_dirname
    from ckpt.storage import Storage

    create = Storage.create_local

    class Dying:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            n = self.f.write(data)
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
            return n

    def dying(self, rel):
        f = create(self, rel)
        if "/peer-" in self.url and rel.startswith(step_dirname(step) + "/") \
                and data_file_id(rel.rsplit("/", 1)[-1]):
            return Dying(f)
        return f

    Storage.create_local = dying


def resume_body(rank: int, world: int, root: str, local_root: str, total: int,
                durable: str = DURABLE_EVERY, per_node: int = 1) -> dict:
    """A new job on the same roots (some nodes' local roots wiped or damaged by the test):
    resume, train on to ``total`` and compare with a run that never stopped."""
    from ckpt.dcp.api import resolve_state
    from tests.ckpt._helpers import assert_same, snapshot
    from tests.ckpt._mgr_workers import _train

    model, opt = _model(rank)
    mgr = _mgr(root, local_root, rank // per_node, durable)
    state = _state(rank, model, opt, 0)
    m = mgr.load_latest(state)
    out = {"step": m.step if m is not None else None,
           "tier": mgr.resumed.tier if mgr.resumed else None,
           **_kinds(mgr, "copy_restored", "copy_failed", "load_fallback")}
    _steps(mgr, rank, model, opt, (m.step if m is not None else 0) + 1, total)
    mgr.close()
    ref_model, ref_opt = _model(rank)
    for step in range(1, total + 1):
        _train([(ref_model, ref_opt)], rank, step)
    assert_same(snapshot(resolve_state(_state(rank, ref_model, ref_opt, total))),
                snapshot(resolve_state(_state(rank, model, opt, total))), f"rank {rank}")
    return out
