"""``ckpt.events.KINDS`` is the list of every event kind, true and complete: read from every
``emit`` call in ``ckpt/`` and ``trainer/`` (ast), and from every kind ``monitoring/`` reads.
Events that cross from a writer process go through ``EventBus.forward``, in one place, which
refuses what ``KINDS`` does not list."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ckpt
from ckpt.cadence import parse_interval
from ckpt.cadence.policies import EverySeconds, EverySteps
from ckpt.dcp import SaveCost
from ckpt.events import KINDS, LOCAL_PREFIX, EventBus, tier_of

REPO = Path(ckpt.__file__).resolve().parents[1]


def _emits() -> list[tuple[str, ast.Call]]:
    """Every ``<anything>.emit(...)`` call in ckpt/ and trainer/, with where it is."""
    out = []
    for pkg in ("ckpt", "trainer"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "emit" and node.args:
                    out.append((f"{path.relative_to(REPO)}:{node.lineno}", node))
    return out


def _is_local_forward(kind: ast.expr) -> bool:
    """``f"local_{...}"`` or ``LOCAL_PREFIX + ...``: the two-tier manager re-emitting."""
    if isinstance(kind, ast.JoinedStr):
        head = kind.values[0]
        return isinstance(head, ast.Constant) and head.value == LOCAL_PREFIX
    return isinstance(kind, ast.BinOp) and isinstance(kind.left, ast.Name) and \
        kind.left.id == "LOCAL_PREFIX"


def _emitted() -> dict[str, set[str]]:
    """{kind: field names passed by name} over every emit call (local kinds folded in)."""
    kinds: dict[str, set[str]] = {}
    wrong = []
    for where, call in _emits():
        kind = call.args[0]
        if _is_local_forward(kind):
            continue
        if not (isinstance(kind, ast.Constant) and isinstance(kind.value, str)):
            wrong.append(f"{where}: the kind is not a string literal: {ast.unparse(kind)}")
            continue
        tier, base = tier_of(kind.value)
        names = {k.arg for k in call.keywords if k.arg is not None}
        if tier == "local":
            names.discard("tier")
        kinds.setdefault(base, set()).update(names)
        if base not in KINDS:
            wrong.append(f"{where}: kind {kind.value!r} is not in ckpt.events.KINDS")
        elif names - set(KINDS[base]):
            wrong.append(f"{where}: {kind.value} fields {sorted(names - set(KINDS[base]))} "
                         f"are not in ckpt.events.KINDS")
    assert not wrong, "\n".join(wrong)
    return kinds


def test_every_emitted_kind_and_field_is_documented():
    _emitted()


def test_every_documented_kind_and_field_is_emitted():
    emitted = _emitted()
    # Fields passed as ``**mapping``: the mappings' own keys.
    emitted["save_cost"] |= set(SaveCost().fields())
    for policy in (EverySteps(5), EverySeconds(5.0), parse_interval("auto")):
        emitted["cadence"] |= set(policy.describe())
    for kind, fields in KINDS.items():
        assert kind in emitted, f"KINDS lists {kind!r}, which nothing emits"
        assert set(fields) == emitted[kind], (kind, sorted(set(fields) ^ emitted[kind]))


def test_the_local_tier_is_forwarded_in_one_place():
    forwards = [where for where, call in _emits() if _is_local_forward(call.args[0])]
    assert len(forwards) == 1 and forwards[0].startswith("ckpt/job/tiers.py"), forwards


def test_a_writer_process_is_forwarded_in_one_place():
    forwards = []
    for pkg in ("ckpt", "trainer"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "forward" and "events" in ast.unparse(node.func):
                    forwards.append(str(path.relative_to(REPO)))
    assert forwards == ["ckpt/job/_writer_process.py"], forwards


def test_forward_refuses_what_kinds_does_not_list():
    bus = EventBus(rank=3)
    got = []
    bus.subscribe(got.append)
    ev = bus.forward("save_committed", 7, {"bytes": 10})
    assert (ev.kind, ev.step, ev.fields, ev.rank) == ("save_committed", 7, {"bytes": 10}, 3)
    bus.forward(LOCAL_PREFIX + "save_staged", 7, {"tier": "local"})
    with pytest.raises(ValueError, match="'save_comitted' is not in ckpt.events.KINDS"):
        bus.forward("save_comitted", 7, {})
    with pytest.raises(ValueError, match=r"fields \['nbytes'\] are not in"):
        bus.forward("save_committed", 7, {"nbytes": 10})
    assert [e.kind for e in got] == ["save_committed", "local_save_staged"]


def test_monitoring_reads_only_documented_kinds():
    read = set()
    for path in (REPO / "monitoring").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) \
                    and node.left.id in ("k", "kind"):
                read |= {tier_of(c.value)[1] for c in node.comparators
                         if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    assert read, "found no kind monitoring/ reads"
    assert read <= set(KINDS), sorted(read - set(KINDS))


def test_tier_of():
    assert tier_of("local_save_committed") == ("local", "save_committed")
    assert tier_of("save_committed") == ("durable", "save_committed")
    bus = EventBus()
    assert bus.emit(LOCAL_PREFIX + "save_staged", 3).kind == "local_save_staged"
