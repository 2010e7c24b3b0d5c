"""Rank agreement (``ckpt.ranks.Agreement``) and the agreed due check (``ckpt.job.gate``).

``Agreement.min`` and ``any_and_min`` are the one home of the "minimum as a MAX of negated
values" trick; ``DueAgreement`` is the one rule for a time-based save decision (agreed only
every ``check_every`` steps, the smallest period any rank proposes), used by the manager's
save gate and by the two-tier manager across nodes. In one process every answer is the
local one; on two gloo ranks the answers are agreed.
"""

from __future__ import annotations

import torch.distributed as dist

from ckpt.job.gate import DueAgreement
from ckpt.ranks import Agreement
from tests.dist import run_ranks


class _Cadence:
    """A cadence stub: ``deterministic`` or time-based, with an interval in steps."""

    def __init__(self, interval_steps: int | None, deterministic: bool = False):
        self.interval_steps, self.deterministic = interval_steps, deterministic

    def describe(self) -> dict:
        return {"interval_steps": self.interval_steps}


def test_one_process_answers_are_the_local_ones():
    ag = Agreement()
    assert ag.min(3, -2) == [3, -2]
    assert ag.any_and_min([True, False], [7]) == ([True, False], [7])
    assert ag.any_and_min([], [4, 5]) == ([], [4, 5])
    due = DueAgreement(ag)
    assert due.agree(_Cadence(200), False, True) == [False, True]
    assert due.check_every == 10  # ~1/20 of the interval
    assert due.decide(_Cadence(200), 15, True) is False  # not a step that is checked
    assert due.decide(_Cadence(200), 20, True) is True
    assert due.decide(_Cadence(200, deterministic=True), 15, True) is True
    assert due.decide(None, 15, True) is True  # no cadence: the caller's answer as it is
    assert due.agree(_Cadence(None), False) == [False] and due.check_every == 1


def _body(rank: int, world: int) -> dict:
    ag = Agreement(dist.new_group(backend="gloo"))
    out: dict = {"min": ag.min(3 + rank, 10 - rank),
                 "any_and_min": ag.any_and_min([rank == 1, False], [40 - 20 * rank, 7])}
    due = DueAgreement(ag)
    # Rank 0 proposes a period of 10 steps, rank 1 of 5: the smaller one wins on both.
    out["agree"] = due.agree(_Cadence(200 if rank == 0 else 100), rank == 0)
    out["check_every"] = due.check_every
    timed = _Cadence(100)
    out["step 7"] = due.decide(timed, 7, True)  # not checked: no collective, not due
    out["step 10"] = due.decide(timed, 10, rank == 1)  # one rank's True wins
    out["deterministic"] = due.decide(_Cadence(100, deterministic=True), 10, rank == 0)
    return out


def test_two_ranks_agree_minima_flags_and_the_check_period():
    results = run_ranks(_body, 2, timeout=120)
    for rank, out in enumerate(results):
        assert out["min"] == [3, 9], out
        assert out["any_and_min"] == ([True, False], [20, 7]), out
        assert out["agree"] == [True] and out["check_every"] == 5, out
        assert out["step 7"] is False and out["step 10"] is True, out
        assert out["deterministic"] is (rank == 0), out  # the same on every rank by nature
