"""The local tier of a job whose tensors are sharded across nodes (FSDP2 over every rank).

Each node's local version holds its share of the job's step (its manifest's ``span``): its
ranks' shards, a tensor sharded across nodes only in part. Real gloo processes act as 2
nodes of 1 or 2 ranks (each node its own local root). A node's root is wiped, as a replaced
machine comes back empty: with copies on the next node the job still resumes from the local
tier, bit for bit; without, it falls back to the durable tier, never to a partial load. A
partial version is refused, in one line, wherever it cannot serve: on another node's ranks,
into a state sharded otherwise, in one process, by an export.
"""

from __future__ import annotations

import pytest

from tests.ckpt.job import _tier_workers as w
from tests.dist import run_ranks


@pytest.mark.parametrize("per_node", [2, 1])
def test_fsdp_across_nodes_resumes_from_the_local_tier_through_a_copy(per_node, tmp_path,
                                                                      capsys):
    """2 nodes x 1 or 2 ranks, copies on the next node: node 1 wiped, its share comes back
    from node 0's copy and the job resumes from local step 6 bit for bit (durable has only
    4)."""
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    out = run_ranks(w.fsdp_nodes_body, 2 * per_node, root, local, per_node, 2, timeout=240)
    w.assert_refused_where_partial(out, per_node=per_node)
    for rank, r in enumerate(out):
        step, tier, events = r["wiped"]
        assert (step, tier) == (6, "local"), r
        # Node 1's coordinator fetched its share back from node 0's copy.
        assert events["copy_restored"] == ([6] if rank == per_node else []), (rank, events)
    if per_node == 2:
        _partial_root_refused_by_tools(tmp_path, capsys)


def _partial_root_refused_by_tools(tmp_path, capsys) -> None:
    """In one process, node 0's local root: verified and shown as one node's share (the
    coverage rule admits it); a load and an export are refused in one line."""
    import ckpt
    from ckpt.cli import main as cli_main
    from ckpt.errors import PartialCheckpointError
    from ckpt.export import export

    def cli(*argv) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli_main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    local0 = str(tmp_path / "local-0")
    share = "node 0's share of a job of 2 nodes (ranks 0-1 of 4)"
    m = ckpt.CheckpointStore(local0).verify(6)  # every part read, every checksum checked
    assert m.span is not None and m.span.describe() == share
    with pytest.raises(PartialCheckpointError, match="loads only on that layout") as info:
        ckpt.load({"progress": {"step": -1}}, local0, 6, strict=False)
    assert "\n" not in str(info.value)
    with pytest.raises(PartialCheckpointError, match="node 0's share") as info:
        export(local0, 6, str(tmp_path / "out.pt"))
    assert "\n" not in str(info.value) and not (tmp_path / "out.pt").exists()
    rc, out, _ = cli("verify", local0, "--step", 6)
    assert rc == 0 and out.strip().endswith(f"; {share})"), out
    rc, out, _ = cli("show", local0, "--step", 6)
    assert rc == 0 and f"share        {share}: loads only on that layout" in out, out
    rc, out, err = cli("export", local0, "--step", 6, "--out", tmp_path / "out.pt")
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and share in err, err


def test_ckpt_diff_never_assembles_a_tensor_a_share_holds_in_part(tmp_path):
    """Two shares of one node chunked differently (the job changed its layout between them):
    ``ckpt diff`` does not compare what it would have to assemble from a part."""
    import torch

    from ckpt.cli import _inspection
    from ckpt.format import Span
    from ckpt.root import CheckpointStore
    from tests.ckpt._parts import save_chunked

    root, span = str(tmp_path / "local-0"), Span(node=0, nodes=2, ranks=(0,), world_size=1)
    save_chunked(root, 1, {"w": torch.arange(6.0)}, {"w": [([2], [4])]}, span=span)
    save_chunked(root, 2, {"w": torch.arange(6.0)}, {"w": [([2], [2]), ([4], [2])]}, span=span)
    store = CheckpointStore(root)
    out = _inspection.diff(store, _inspection.select(store, 1, None),
                           _inspection.select(store, 2, None))
    (row,) = out["tensors"]
    assert row["status"] == "not_compared" and "only in part" in row["reason"], row
