"""ckpt.format.jsonio: strict JSON in and out; hostile input is a named error, never a crash."""

from __future__ import annotations

import json
import math
import time

import pytest

from ckpt.errors import CorruptCheckpointError
from ckpt.format import jsonio

SRC = "root/step_000000001/thing.json"


def _refused(data, match, **kw) -> CorruptCheckpointError:
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        jsonio.loads(data, SRC, **kw)
    assert info.value.path == SRC and SRC in str(info.value)
    assert "Restore or delete it" in str(info.value)  # the fix
    return info.value


def test_round_trip_of_plain_values():
    doc = {"a": [1, -2, 3.5, "x", None, True, False], "b": {"c": {}}, "é": "ü\u2603"}
    assert jsonio.loads(jsonio.dumps(doc), SRC) == doc
    assert jsonio.loads(jsonio.dumps(doc, indent=1).decode(), SRC) == doc  # str input too
    assert json.loads(jsonio.dumps(doc)) == doc  # plain JSON for any other reader


def test_non_finite_floats_round_trip_with_the_documented_encoding():
    doc = {"loss": math.nan, "best": math.inf, "worst": -math.inf, "ok": 1.5,
           "nested": [{"x": math.nan}]}
    data = jsonio.dumps(doc)
    assert b"NaN" not in data and b"Infinity" not in data
    assert json.loads(data)["loss"] == {"__float__": "nan"}
    assert json.loads(data)["worst"] == {"__float__": "-inf"}
    back = jsonio.loads(data, SRC)
    assert math.isnan(back["loss"]) and math.isnan(back["nested"][0]["x"])
    assert back["best"] == math.inf and back["worst"] == -math.inf and back["ok"] == 1.5


@pytest.mark.parametrize("literal", [
    {"__float__": "nan"}, {"__float__": "other"}, {"__literal__": ["a", 1]},
    {"__literal__": {"__float__": "inf"}}, {"__float__": "nan", "x": 1},
])
def test_user_objects_shaped_like_tags_come_back_unchanged(literal):
    doc = {"user": literal, "list": [literal]}
    assert jsonio.loads(jsonio.dumps(doc), SRC) == doc


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", '{"loss": NaN}',
                                  '[1, Infinity]'])
def test_bare_non_finite_literals_are_refused(text):
    _refused(text, "not JSON")


def test_invalid_utf8_and_invalid_json():
    _refused(b"\xff\xfe{}", "not valid UTF-8")
    _refused(b'{"a": "\xc3"}', "not valid UTF-8")
    _refused(b"{not json", "not valid JSON")
    _refused(b"", "not valid JSON")
    _refused(b'{"a": 1}{"b": 2}', "not valid JSON")
    _refused('{"a": 1, "a": 2}', "duplicate key 'a'")


@pytest.mark.parametrize("depth", [65, 1000, 100_000, 1_000_000])
def test_deep_nesting_is_refused_without_recursion(depth):
    for opener, closer in (("[", "]"), ('{"k":', "}")):
        start = time.monotonic()
        _refused(opener * depth + "1" + closer * depth, "nested deeper than 64")
        _refused(opener * depth, "nested deeper than 64")  # unterminated too
        assert time.monotonic() - start < 5


def test_depth_limit_is_exact_and_strings_do_not_count():
    assert jsonio.loads("[" * 64 + "]" * 64, SRC) is not None
    _refused("[" * 65 + "]" * 65, "nested deeper")
    assert jsonio.loads("[" * 10 + "]" * 10, SRC, max_depth=10)
    _refused("[" * 11 + "]" * 11, "nested deeper than 10", max_depth=10)
    brackets = '"' + "[{" * 5000 + '\\"]' + '"'
    assert jsonio.loads(f'{{"s": {brackets}}}', SRC)["s"].startswith("[{[{")
    wide = "[" + ",".join(["[1]"] * 100_000) + "]"  # many brackets, shallow
    assert len(jsonio.loads(wide, SRC)) == 100_000


def test_huge_numbers_are_refused():
    _refused("1" + "0" * 5000, "integer of 5001 digits")
    _refused('{"step": -' + "9" * 301 + "}", "integer of 301 digits")
    assert jsonio.loads("9" * 300, SRC) == int("9" * 300)
    _refused("1e999", "overflows")
    _refused("-1e400", "overflows")
    _refused("0." + "1" * 5000, "number literal")
    assert jsonio.loads("1e-999", SRC) == 0.0


def test_size_limit():
    _refused(b"[" + b"0," * 600 + b"0]", "more than the 1000 allowed", max_bytes=1000)
    assert len(jsonio.loads(b"[" + b"0," * 400 + b"0]", SRC, max_bytes=1000)) == 401


def test_dumps_is_strict():
    with pytest.raises(TypeError):
        jsonio.dumps({"x": object()})
    assert jsonio.dumps({"b": 1, "a": 2}) == b'{"b":1,"a":2}'
    assert jsonio.dumps((1, 2)) == b"[1,2]"


@pytest.mark.parametrize("text", ['{"__float__": "abc"}', '{"__float__": 1}',
                                  '[{"__literal__": "ab"}]', '{"__literal__": [1, 2]}'])
def test_tag_objects_with_payloads_dumps_never_writes_are_refused(text):
    _refused(text, "the tag holds")
