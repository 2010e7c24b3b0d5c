"""Rank agreement (``ckpt.ranks.Agreement``) and the one save decision (``ckpt.job.gate``).

``Agreement.min`` and ``any_and_min`` are the one home of the "minimum as a MAX of negated
values" trick; ``SaveGate.decide`` is the one rule for a save decision (a time-based cadence
agreed only every ``check_every`` steps, the smallest period any rank proposes, together
with the save's checks in one all-reduce), used by every manager (a two-tier job's local
tier over the whole job). In one process every answer is the local one; on two gloo ranks
the answers are agreed.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from ckpt.job.gate import Decision, SaveChecks, SaveGate, SaveInputs
from ckpt.ranks import Agreement
from ckpt.root import Lifecycle
from ckpt.storage import Storage
from tests.dist import run_ranks


class _Cadence:
    """A cadence stub: ``deterministic`` or time-based, with an interval in steps, wanting a
    save (``want``) or not at every step."""

    def __init__(self, interval_steps: int | None, deterministic: bool = False,
                 want: bool = True):
        self.interval_steps, self.deterministic, self.want = interval_steps, deterministic, want

    def describe(self) -> dict:
        return {"interval_steps": self.interval_steps}

    def should_save(self, step: int, now: float) -> bool:
        return self.want


def _gate(ag: Agreement, root: str, coordinator: bool = True) -> SaveGate:
    return SaveGate(ag, Lifecycle(Storage(root)), coordinator)


def _inputs(cadence, *, requested: bool = False, busy: bool = False) -> SaveInputs:
    return SaveInputs(cadence, requested, busy, lease_lost=False, pending_failure=False,
                      last_committed=None)


def test_one_process_answers_are_the_local_ones(tmp_path):
    ag = Agreement()
    assert ag.min(3, -2) == [3, -2]
    assert ag.any_and_min([True, False], [7]) == ([True, False], [7])
    assert ag.any_and_min([], [4, 5]) == ([], [4, 5])
    gate = _gate(ag, str(tmp_path))
    assert gate.decide(20, _inputs(_Cadence(200), busy=True)) == \
        Decision(True, SaveChecks(busy=True, exists=False, lost=False, failed=False))
    assert gate.check_every == 10  # ~1/20 of the interval
    assert gate.decide(15, _inputs(_Cadence(200))) == Decision(False, None)  # not checked
    assert gate.decide(20, _inputs(_Cadence(200))).due is True
    assert gate.decide(20, _inputs(_Cadence(200, want=False))) == Decision(False, None)
    assert gate.decide(15, _inputs(_Cadence(200, deterministic=True))).due is True
    assert gate.decide(15, _inputs(None)) == Decision(False, None)  # no cadence: never
    # save(): due whatever the cadence; a cadence without an estimate checks every step.
    assert gate.decide(15, _inputs(None, requested=True)).due is True
    assert gate.check_every == 1


class _Opens:
    """Unpickled, it creates the file ``path``: proof that a peer's bytes were unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _raw_send(group, payload: bytes, *, broadcast: bool) -> None:
    """What a rank that does not follow the protocol puts on the wire: ``payload`` in the
    framing ``Agreement`` uses (a length, then the bytes), which is also torch's
    ``*_object`` collectives' (a length, then the pickle)."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    if broadcast:
        dist.broadcast(size, src=0, group=group)
        dist.broadcast(data, src=0, group=group)
        return
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(t[0]) for t in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    dist.all_gather([torch.empty(longest, dtype=torch.uint8) for _ in sizes], padded,
                    group=group)


def _refused(call) -> str:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _peer_payloads(rank: int, ag: Agreement, marker: str) -> dict:
    """JSON values in both directions, then a pickle from a peer: refused, never loaded."""
    out = {"gathered": ag.all_gather({"rank": rank, "steps": [rank, 2 * rank]}),
           "broadcast": ag.broadcast(("first", rank) if rank == 0 else None)}
    evil = pickle.dumps(_Opens(marker))
    if rank == 1:  # rank 1 sends a pickle where JSON belongs; rank 0 parses what it got
        _raw_send(ag.group, evil, broadcast=False)
    else:
        out["gather_refused"] = _refused(lambda: ag.all_gather("fine"))
    if rank == 0:  # the same from the first rank of a broadcast
        _raw_send(ag.group, evil, broadcast=True)
    else:
        out["broadcast_refused"] = _refused(lambda: ag.broadcast(None))
    dist.barrier(ag.group)
    out["unpickled"] = os.path.exists(marker)
    return out


def _body(rank: int, world: int, marker: str) -> dict:
    ag = Agreement(dist.new_group(backend="gloo"))
    out: dict = {"min": ag.min(3 + rank, 10 - rank),
                 "any_and_min": ag.any_and_min([rank == 1, False], [40 - 20 * rank, 7])}
    gate = _gate(ag, os.path.join(os.path.dirname(marker), f"root{rank}"), rank == 0)
    # Rank 0 proposes a period of 10 steps, rank 1 of 5: the smaller one wins on both; rank
    # 0 is busy, rank 1 not: busy on both (one all-reduce carries the answer and the checks).
    first = gate.decide(1, _inputs(_Cadence(200 if rank == 0 else 100, want=rank == 0),
                                   busy=rank == 0))
    out["agree"] = [first.due, first.checks.busy]
    out["check_every"] = gate.check_every
    out["step 7"] = gate.decide(7, _inputs(_Cadence(100))).due  # not checked: no collective
    out["step 10"] = gate.decide(10, _inputs(_Cadence(100, want=rank == 1))).due  # any wins
    # Deterministic: not wanted, no collective (rank 0 alone asks); wanted: the checks.
    if rank == 0:
        out["not wanted"] = gate.decide(10, _inputs(_Cadence(100, True, want=False)))
    out["deterministic"] = gate.decide(10, _inputs(_Cadence(100, deterministic=True))).due
    out["payloads"] = _peer_payloads(rank, ag, marker)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    marker = str(tmp_path_factory.mktemp("agreement") / "unpickled")
    return run_ranks(_body, 2, marker, timeout=120)


def test_two_ranks_agree_minima_flags_and_the_check_period(two_ranks):
    for rank, out in enumerate(two_ranks):
        assert out["min"] == [3, 9], out
        assert out["any_and_min"] == ([True, False], [20, 7]), out
        assert out["agree"] == [True, True] and out["check_every"] == 5, out
        assert out["step 7"] is False and out["step 10"] is True, out
        assert out["deterministic"] is True, out  # the same on every rank by nature
        assert rank == 1 or out["not wanted"] == (False, None), out


def test_a_peers_payload_is_parsed_as_json_never_unpickled(two_ranks):
    for rank, out in enumerate(two_ranks):
        got = out["payloads"]
        assert got["gathered"] == [{"rank": 0, "steps": [0, 0]}, {"rank": 1, "steps": [1, 2]}]
        assert got["broadcast"] == ["first", 0]  # JSON: a tuple arrives as a list
        assert got["unpickled"] is False, "a peer's pickle was loaded"
    assert "rank 1 of the agreement group sent" in two_ranks[0]["payloads"]["gather_refused"]
    assert "not JSON" in two_ranks[0]["payloads"]["gather_refused"]
    assert "rank 0 of the agreement group sent" in two_ranks[1]["payloads"]["broadcast_refused"]


def test_values_that_are_not_json_are_refused_before_they_are_sent():
    ag = Agreement()
    with pytest.raises(TypeError, match="dict key 1 is not a str"):
        ag.broadcast({1: "a"})  # JSON would give it back as "1"
    with pytest.raises(TypeError, match="Agreement values are JSON"):
        ag.all_gather({"steps": {1, 2}})
    assert ag.broadcast((1, [None, 2.5])) == [1, [None, 2.5]]  # as on several ranks
