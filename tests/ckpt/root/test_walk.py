"""The one walk to the newest usable checkpoint (``ckpt.root.walk_newest``).

Every resume walks through it: ``CheckpointStore.latest`` (no load), ``ckpt.load_latest``
and ``CheckpointManager.load_latest`` (a load, agreed by every rank) and the two-tier resume
(candidates of two roots, the local tier tolerant). Here in one process: the order (newest
first, the given order within a step), what passes a candidate over (damage, in the check or
the load; any error of a tolerant candidate) and what is raised, the one fallback message,
``failures`` and ``AllCheckpointsDamagedError``, and a verdict another rank vetoes.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import ckpt
from ckpt.errors import AllCheckpointsDamagedError, CorruptCheckpointError, StateMismatchError
from ckpt.root import Candidate, CheckpointStore, walk_newest
from tests.ckpt._helpers import flip_byte


def _root(path, steps) -> CheckpointStore:
    for step in steps:
        ckpt.save({"m": {"w": torch.full((16,), float(step))}}, str(path), step)
    return CheckpointStore(str(path))


def _data_file(store: CheckpointStore, step: int) -> str:
    folder = os.path.join(store.storage.url, f"step_{step:09d}")
    return next(os.path.join(folder, n) for n in sorted(os.listdir(folder))
                if n.endswith(".bin"))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("ckpt") and r.levelno >= logging.WARNING]


def test_newest_first_and_the_given_order_within_a_step(tmp_path):
    fast, slow = _root(tmp_path / "fast", [2, 4]), _root(tmp_path / "slow", [3, 4])
    tried = []

    def load(candidate, manifest):
        tried.append((candidate.step, candidate.tier))
        raise CorruptCheckpointError("damaged on purpose")

    walked = walk_newest(fast.candidates("fast") + slow.candidates("slow"), load=load)
    assert tried == [(4, "fast"), (4, "slow"), (3, "slow"), (2, "fast")]
    assert walked.candidate is None and walked.manifest is None
    assert [s for s, _ in walked.failures] == [4, 4, 3, 2]
    assert walked.failures[0] == (4, "fast tier: damaged on purpose")


def test_the_first_that_loads_is_the_answer(tmp_path):
    store = _root(tmp_path, [1, 2, 3])
    loaded = []
    walked = walk_newest(store.candidates(), load=lambda c, m: loaded.append(m.step))
    assert loaded == [3] and walked.manifest.step == 3 and walked.candidate.step == 3
    assert walked.failures == []


def test_a_candidate_that_fails_its_check_is_not_loaded_and_reads_naturally(tmp_path, caplog):
    store = _root(tmp_path, [1, 2])
    with open(_data_file(store, 2), "r+b") as f:
        f.truncate(3)
    loaded, reported = [], []
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        walked = walk_newest(store.candidates(), load=lambda c, m: loaded.append(c.step),
                             on_fallback=lambda c, message: reported.append((c.step, message)))
    assert loaded == [1] and walked.manifest.step == 1
    [(step, message)] = reported
    assert step == 2
    assert message.startswith("checkpoint step 2 is not usable (")
    assert message.endswith("); falling back to an earlier one")
    assert _warnings(caplog) == [message]
    assert walked.failures == [(2, message[len("checkpoint step 2 is not usable ("):
                                            -len("); falling back to an earlier one")])]


def test_a_load_that_fails_verification_falls_back_with_one_message(tmp_path):
    store = _root(tmp_path, [1, 2])
    flip_byte(_data_file(store, 2), 5)  # same size: only the load's checksums see it
    reported = []
    state = {"m": {"w": torch.zeros(16)}}
    walked = walk_newest(store.candidates(),
                         load=lambda c, m: ckpt.load(state, store.storage, m),
                         on_fallback=lambda c, message: reported.append(message))
    assert walked.manifest.step == 1 and torch.equal(state["m"]["w"], torch.full((16,), 1.0))
    [message] = reported
    assert message.startswith("checkpoint step 2 failed verification while loading (")
    assert "checksum mismatch" in message and "is failed" not in message


def test_what_is_not_damage_is_raised_unless_the_candidate_is_tolerant(tmp_path):
    store = _root(tmp_path, [1, 2])

    def mismatch(candidate, manifest):
        raise StateMismatchError("the state does not match")

    with pytest.raises(StateMismatchError):
        walk_newest(store.candidates(), load=mismatch)
    tolerant = [Candidate(s, store, "local", tolerant=True) for s in store.committed_steps()]
    walked = walk_newest(tolerant, load=mismatch)
    assert walked.manifest is None and [s for s, _ in walked.failures] == [2, 1]


def test_everything_damaged_is_told_from_nothing_there(tmp_path):
    store = _root(tmp_path / "a", [1, 2])
    for step in (1, 2):
        with open(_data_file(store, step), "r+b") as f:
            f.truncate(1)
    walked = walk_newest(store.candidates())
    with pytest.raises(AllCheckpointsDamagedError) as info:
        walked.raise_if_all_damaged(store.storage.describe())
    assert [s for s, _ in info.value.failures] == [2, 1]
    empty = walk_newest(CheckpointStore(str(tmp_path / "empty")).candidates())
    empty.raise_if_all_damaged("nowhere")  # no candidates: nothing there, no error
    assert empty.manifest is None and empty.failures == []


class _Veto:
    """An agreement in which another rank fails the first verdict asked (``all`` False)."""

    def __init__(self):
        self.asked: list[bool] = []

    def all(self, ok: bool) -> bool:
        self.asked.append(ok)
        return ok and len(self.asked) > 1

    def any_and_min(self, flags, values):  # the read verdict, with the versions' runs
        return [not self.all(not any(flags))], list(values)


def test_a_verdict_another_rank_vetoes_passes_the_candidate_over(tmp_path):
    store = _root(tmp_path, [1, 2])
    veto = _Veto()
    reported = []
    walked = walk_newest(store.candidates(), load=lambda c, m: None, agreement=veto,
                         on_fallback=lambda c, message: reported.append(message))
    assert walked.manifest.step == 1
    assert veto.asked == [True, True, True]  # step 2's check; step 1's check and load
    assert reported == ["checkpoint step 2 is not usable (failed on another rank); falling "
                        "back to an earlier one"]


def test_store_latest_walks_the_same_way(tmp_path, caplog):
    store = _root(tmp_path, [1, 2])
    flip_byte(_data_file(store, 2), 5)
    assert store.latest(check="size").step == 2  # a same-size flip passes a size check
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert store.latest(check="full").step == 1
    [warning] = _warnings(caplog)
    assert warning.startswith("checkpoint step 2 is not usable (")


def test_load_latest_reports_each_fallback_once_in_plain_words(tmp_path):
    store = _root(tmp_path, [1, 2])
    flip_byte(_data_file(store, 2), 5)
    reported = []
    state = {"m": {"w": torch.zeros(16)}}
    manifest = ckpt.load_latest(state, str(tmp_path),
                                on_fallback=lambda step, message: reported.append((step, message)))
    assert manifest.step == 1
    [(step, message)] = reported
    assert step == 2 and message.startswith("checkpoint step 2 failed verification while ")
