"""Bodies of the lineage tests on two ranks as two nodes (module-level: run_ranks pickles
them by name). Each phase is one job: it constructs the manager, acts, closes."""

from __future__ import annotations

import torch


def _value(rank: int, step: int, run: str) -> float:
    return float(step + 1000 * rank + {"A": 0, "B": 500, "C": 700}[run])


def _mgr(base: str, rank: int):
    from ckpt.job import KeepLast, LocalTierOptions, ManagerOptions, TieredCheckpointManager

    return TieredCheckpointManager(f"{base}/durable", f"{base}/local{{node}}",
                                   ManagerOptions(lease_ttl_seconds=5.0),
                                   local=LocalTierOptions(node_rank=rank,
                                                          retention=[KeepLast(10)]))


def tier_phase(rank: int, world: int, base: str, phase: str) -> dict:
    """``run1``: trajectory A saves local 10..50. ``run2``: resume, then B saves 40, 50.
    ``run3``: resume; returns the step, tier and which trajectory each rank got."""
    mgr = _mgr(base, rank)
    state = {"w": torch.zeros(4)}
    out: dict = {}
    try:
        if phase == "run1":
            for step in (10, 20, 30, 40, 50):
                state["w"].fill_(_value(rank, step, "A"))
                mgr.local.save(step, state, block=True)
        elif phase == "run2":
            m = mgr.load_latest(state)
            out["resumed"] = m.step if m else None
            for step in (40, 50):
                state["w"].fill_(_value(rank, step, "B"))
                mgr.local.save(step, state, block=True)
        else:
            m = mgr.load_latest(state)
            w = state["w"][0].item()
            out["resumed"], out["tier"] = (m.step if m else None), (
                mgr.resumed.tier if mgr.resumed else None)
            out["trajectory"] = next((t for t in "ABC" if m and w == _value(rank, m.step, t)),
                                     None if m else "none")
    finally:
        mgr.close()
    return out


def walk_two_roots(rank: int, world: int, base: str) -> dict:
    """Each rank walks its own root (as each node its local tier) with the job's agreement:
    step 5 is one version copied into both roots, step 10 two versions of two runs (two
    ``ckpt.save`` calls, each a run of its own). Returns the step loaded and the reasons of
    the steps passed over."""
    import shutil

    import torch.distributed as dist

    import ckpt
    from ckpt.ranks import Agreement
    from ckpt.root import Candidate, CheckpointStore, walk_newest

    root = f"{base}/root{rank}"
    alone = [dist.new_group([r], backend="gloo") for r in range(world)][rank]
    if rank == 0:
        ckpt.save({"w": torch.full((4,), 5.0)}, f"{base}/root0", 5, process_group=alone)
        shutil.copytree(f"{base}/root0/step_000000005", f"{base}/root1/step_000000005")
    dist.barrier()
    ckpt.save({"w": torch.full((4,), 10.0 + rank)}, root, 10, process_group=alone)
    store = CheckpointStore(root)
    loaded: list[int] = []
    walked = walk_newest([Candidate(s, store) for s in store.committed_steps()],
                         load=lambda c, m: loaded.append(c.step),
                         agreement=Agreement(dist.group.WORLD))
    return {"step": walked.manifest.step if walked.manifest else None, "loaded": loaded,
            "failures": walked.failures}
