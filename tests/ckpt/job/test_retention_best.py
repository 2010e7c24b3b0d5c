"""Best-k retention by a metric (``KeepBest``, Lightning's ``save_top_k``/``monitor``, Orbax's
``best_fn``): the k best by a ``user_metadata`` value, min or max; never the newest, a pinned
or an in-flight checkpoint; each manifest read once; and ``ckpt list`` says which are kept
for that reason (the manager records its best-k policies at the root)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import ckpt
from ckpt.cli import main as cli_main
from ckpt.job import CheckpointManager, KeepBest, KeepLast, read_retention, set_pinned
from ckpt.job.retention import RETENTION_NAME, apply_retention
from ckpt.root import CheckpointStore

pytestmark = pytest.mark.timeout(120)

LOSSES = {10: 0.5, 20: 0.1, 30: float("nan"), 40: 0.3, 50: None, 60: 0.9, 70: 0.3}


def _root(tmp_path, losses=LOSSES) -> CheckpointStore:
    root = str(tmp_path / "root")
    for step, loss in losses.items():
        meta = {} if loss is None else {"loss": loss, "acc": -loss if loss == loss else loss}
        ckpt.save({"w": torch.full((4,), float(step))}, root, step, user_metadata=meta)
    return CheckpointStore(root)


def test_keep_best_ranks_by_a_metric(tmp_path):
    store = _root(tmp_path)
    steps = store.committed_steps()
    assert KeepBest(store, "loss", k=2).keep(steps) == {20, 70}  # 0.1; 0.3 twice: the newer
    assert KeepBest(store, "loss", k=3, mode="min").keep(steps) == {20, 40, 70}
    assert KeepBest(store, "acc", k=1, mode="max").keep(steps) == {20}
    assert KeepBest(store, "loss", k=100, mode="max").keep(steps) == {10, 20, 40, 60, 70}
    assert KeepBest(store, "no-such-key", k=3).keep(steps) == set()  # NaN, missing: never best
    for bad, match in [(dict(key=""), "name a user_metadata key"), (dict(k=0), "k must be"),
                       (dict(k=True), "k must be"), (dict(mode="lowest"), "expected 'min'")]:
        with pytest.raises(ValueError, match=match):
            KeepBest(store, **{"key": "loss", **bad})


def test_apply_retention_with_keep_best_spares_newest_and_pinned(tmp_path):
    store = _root(tmp_path)
    set_pinned(store, 10)
    deleted = apply_retention(store, [KeepBest(store, "loss", k=1)])
    # Best: 20. The newest (70) always stays; 10 is pinned, though no policy says KeepPinned.
    assert deleted == [30, 40, 50, 60]
    assert store.committed_steps() == [10, 20, 70]


def test_keep_best_reads_each_manifest_once(tmp_path):
    store = _root(tmp_path, {10: 0.5, 20: 0.4})
    reads = []
    seen = CheckpointStore(store.storage)  # the policy's, counting its reads
    real = seen.read_manifest
    seen.read_manifest = lambda step: reads.append(step) or real(step)
    policy = KeepBest(seen, "loss", k=1)
    apply_retention(store, [policy])
    assert sorted(reads) == [10, 20] and store.committed_steps() == [20]
    ckpt.save({"w": torch.zeros(4)}, store.storage, 30, user_metadata={"loss": 0.1})
    # The manifest just committed is handed over (newest_manifest), not read back.
    apply_retention(store, [policy], newest_manifest=real(30))
    assert sorted(reads) == [10, 20] and store.committed_steps() == [30]


def test_manager_keeps_the_best_and_ckpt_list_says_why(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    losses = {2: 0.9, 4: 0.3, 6: 0.5, 8: 0.2, 10: 0.7, 12: 0.8}
    retention = [KeepLast(2), KeepBest(CheckpointStore(root), "loss", k=2)]
    with CheckpointManager(root, busy="wait", cadence="2",
                           retention=retention) as mgr:
        for step in range(1, 13):
            mgr.maybe_save(step, {"w": torch.ones(2) * step},
                           user_metadata={"loss": losses.get(step, math.inf)})
        mgr.wait()
        assert mgr.all_steps() == [4, 8, 10, 12] and mgr.latest_step() == 12
    assert [p.describe() for p in read_retention(CheckpointStore(root))] == \
        [{"key": "loss", "k": 2, "mode": "min"}]
    set_pinned(CheckpointStore(root), 10)
    capsys.readouterr()
    assert cli_main(["list", root, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert {s: r["kept_for"] for s, r in rows.items()} == {
        4: ["best 2 by loss (min)"], 8: ["best 2 by loss (min)"], 10: ["pinned"], 12: []}
    assert [s for s, r in rows.items() if r["pinned"]] == [10]
    assert cli_main(["list", root]) == 0
    table = {int(line.split()[0]): line for line in capsys.readouterr().out.splitlines()[1:]}
    assert table[4].endswith("best 2 by loss (min)") and table[10].endswith("pinned")
    # A later job without a best-k policy removes the record: nothing claims that reason.
    with CheckpointManager(root, retention=[KeepLast(5)]):
        pass
    assert not CheckpointStore(root).storage.exists(RETENTION_NAME)
    assert cli_main(["list", root, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[4]["kept_for"] == [] and rows[10]["kept_for"] == ["pinned"]


def test_damaged_record_is_named(tmp_path, capsys):
    store = _root(tmp_path, {10: 0.5})
    store.storage.write_bytes(RETENTION_NAME, b'{"best": [{"key": "loss", "k": "two"}]}')
    with pytest.raises(ValueError, match=f"{RETENTION_NAME} is damaged"):
        read_retention(store)
    capsys.readouterr()
    assert cli_main(["list", store.storage.url]) == 0  # listed all the same, with a warning
    out, err = capsys.readouterr()
    assert out.splitlines()[1].split()[0] == "10"
    assert err.count("\n") == 1 and f"{RETENTION_NAME} is damaged" in err
