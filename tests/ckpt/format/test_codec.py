"""The pickle-free encoding of non-tensor state values, and its guard against per-rank values."""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
from ckpt.format import decode_object, encode_object
from ckpt.format.codec import UnsupportedValueError
from tests.dist import run_ranks


def test_round_trip_of_python_values():
    value = {"int": 3, "float": 0.1, "nan": float("nan"), "inf": float("-inf"), "none": None,
             "tuple": (1, (2, "x")), "list": [1, [2.5]], "bytes": b"\x00\xff",
             "dtype": torch.bfloat16, "device": torch.device("cpu"), 7: "int key",
             "__tuple__": "a key that looks like a tag"}
    out = decode_object(encode_object(value))
    assert math.isnan(out.pop("nan")) and math.isnan(value.pop("nan"))
    assert out == value
    assert isinstance(out["tuple"], tuple) and isinstance(out["tuple"][1], tuple)


def test_unsupported_values_name_the_key():
    with pytest.raises(UnsupportedValueError, match="'cfg.fn'.*cannot be stored without pickle"):
        encode_object(lambda: 0, "cfg.fn")
    with pytest.raises(UnsupportedValueError, match="tensor nested"):
        encode_object((torch.ones(1),), "x")


def test_decoding_never_builds_anything_but_data():
    assert decode_object(b'{"__dtype__": "float32"}') is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        decode_object(b'{"__dtype__": "__class__"}')


def _save_differing_objects(rank, world, root):
    ckpt.save({"w": torch.ones(2), "shared": {"a": 1}}, root, 1)   # equal values: fine
    try:
        ckpt.save({"w": torch.ones(2), "count": rank}, root, 2)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_shared_key_with_different_values_per_rank_is_refused(tmp_path):
    errors = run_ranks(_save_differing_objects, 2, str(tmp_path), timeout=120)
    for err in errors:
        assert err is not None and "'count' (rank 0 | rank 1)" in err and "per-rank key" in err
    store = ckpt.CheckpointStore(str(tmp_path))
    assert store.committed_steps() == [1]      # nothing committed for the refused save


def test_crc32c_combine_matches_a_single_pass():
    import os

    import crc32c

    from ckpt.format import crc32c_combine

    for la, lb in [(0, 5), (5, 0), (1, 1), (100, 3), (3, 100_000), (1 << 20, 12345)]:
        a, b = os.urandom(la), os.urandom(lb)
        assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b)


def test_hostile_object_bytes_are_value_errors_never_crashes():
    for data in (b"[" * 100_000, b'{"__tuple__": ' * 300 + b"1" + b"}" * 300, b"NaN",
                 b"1" * 5000, b'{"__float__": "1e999x"}x', b"\xff"):
        with pytest.raises(ValueError, match="checkpoint object"):
            decode_object(data)
    for data in (b'{"__dict__": 5}', b'{"__bytes__": "%%%"}', b'{"__device__": "nowhere"}'):
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            decode_object(data)


def test_nesting_is_refused_when_saving_not_when_loading():
    deep: list = []
    for _ in range(150):
        deep = [deep]
    with pytest.raises(UnsupportedValueError, match=r"'x\[0\].* nests containers more than 100"):
        encode_object(deep, "x")
    ok: object = 1
    for _ in range(100):
        ok = (ok,) if len(str(ok)) % 2 else [ok]
    assert decode_object(encode_object(ok)) == ok


def test_non_finite_floats_keep_their_encoding_and_tag_shaped_values_round_trip():
    assert encode_object([float("nan"), float("inf")]) == \
        b'[{"__float__":"nan"},{"__float__":"inf"}]'  # the bytes older versions wrote
    value = {"a": {"__literal__": ["k", 1]}, "b": [{"__float__": "nan"}]}
    assert decode_object(encode_object(value)) == value


@pytest.mark.parametrize("data", [
    b'{"__float__": "abc"}', b'{"__float__": 1.5}', b'{"__tuple__": "abc"}',
    b'{"__tuple__": {"a": 1}}', b'{"__dict__": ["ab"]}', b'{"__dict__": [[1, 2, 3]]}',
    b'{"__bytes__": 5}', b'{"__device__": ["cpu"]}', b'{"__tuple__": [1], "x": 2}',
    b'{"__literal__": "ab"}', b'{"__literal__": [1, 2]}', b'[{"__float__": "abc"}]'])
def test_tags_with_payloads_no_encoder_writes_are_refused(data):
    """Every encoder writes a tag alone and with its payload's type; anything else is
    corrupt, never decoded into another value (a string's characters as a tuple ...)."""
    with pytest.raises(ValueError):
        decode_object(data)
