"""StateMismatchError's "Fix:" lines match the problems found: strict=False is offered only
where it helps (missing or unexpected keys), never for a dtype, shape or kind mismatch, which
it does not skip."""

from __future__ import annotations

import pytest
import torch

import ckpt


@pytest.fixture
def root(tmp_path):
    state = {"model": {"w": torch.ones(4, 3), "b": torch.ones(3)}, "meta": {"name": "x"}}
    ckpt.save(state, str(tmp_path), 1)
    return str(tmp_path)


def _error(root, state, **kwargs) -> str:
    with pytest.raises(ckpt.StateMismatchError) as info:
        ckpt.load(state, root, 1, **kwargs)
    return str(info.value)


def test_dtype_mismatch_suggests_a_cast_not_strict_false(root):
    text = _error(root, {"model": {"w": torch.zeros(4, 3, dtype=torch.float64),
                                   "b": torch.zeros(3)}, "meta": {"name": ""}})
    assert "Fix (dtype)" in text and "model.to(torch.float32)" in text, text
    assert "pass strict=False" not in text and "Fix (keys)" not in text, text
    # ... and strict=False indeed does not get past it.
    text = _error(root, {"model": {"w": torch.zeros(4, 3, dtype=torch.float64)}}, strict=False)
    assert "Fix (dtype)" in text and "pass strict=False" not in text, text


def test_shape_mismatch_names_the_configuration(root):
    text = _error(root, {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(3)},
                         "meta": {"name": ""}})
    assert "Fix (shape)" in text and "pass strict=False" not in text, text


def test_unexpected_keys_offer_strict_false_and_ignore_keys(root):
    text = _error(root, {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}})
    assert "Fix (keys)" in text and "strict=False" in text and "ignore_keys=" in text, text
    assert "Fix (dtype)" not in text and "Fix (shape)" not in text, text
    # Both advertised ways work.
    state = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
    ckpt.load(state, root, 1, ignore_keys=("meta.",))
    assert torch.equal(state["model"]["w"], torch.ones(4, 3))
    ckpt.load({"model": {"w": torch.zeros(4, 3)}}, root, 1, strict=False)


def test_every_kind_present_gets_its_line(root):
    text = _error(root, {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(3, dtype=torch.half),
                                   "new": torch.zeros(1)}, "meta": {"name": ""}})
    for line in ("Fix (keys)", "Fix (shape)", "Fix (dtype)"):
        assert line in text, (line, text)
    assert "ignore_keys=" not in text  # a missing key is not helped by ignore_keys
