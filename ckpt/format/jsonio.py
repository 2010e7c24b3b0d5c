"""Strict JSON for every file ``ckpt`` writes and reads (manifests, markers, pins, history).

Everything read back from storage is untrusted input, so :func:`loads` refuses what
Python's ``json`` would accept or crash on: invalid UTF-8, ``NaN``/``Infinity`` literals,
duplicate object keys, nesting deeper than ``max_depth`` (checked by a scan before parsing,
so a hostile document cannot reach a ``RecursionError``), integers of more than
``MAX_INT_DIGITS`` digits, floats that overflow, and documents larger than ``max_bytes``.
Every refusal is a :class:`~ckpt.errors.CorruptCheckpointError` naming the source.

Non-finite floats have no JSON literal, so :func:`dumps` writes them as
``{"__float__": "nan"|"inf"|"-inf"}`` (the tag :mod:`ckpt.format.codec` has always used) and
:func:`loads` turns that object back into the float. A literal one-member object whose key
is a tag (``__float__`` or ``__literal__``) is escaped as ``{"__literal__": [key, value]}``
so that it too comes back unchanged. See docs/format.md, *Non-finite numbers*.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ckpt.errors import CorruptCheckpointError

__all__ = ["loads", "dumps", "MAX_INT_DIGITS", "FLOAT_TAG", "LITERAL_TAG"]

MAX_INT_DIGITS = 300
_MAX_NUMBER_CHARS = 400  # a float literal longer than this is not something we wrote
FLOAT_TAG = "__float__"
LITERAL_TAG = "__literal__"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1
# A run of more digits than any integer may have: without one anywhere in a document (the
# usual case), no integer needs the digit check and the decoder parses ints natively.
_ONLY_DIGITS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_LONG_DIGITS = b"0" * (MAX_INT_DIGITS + 1)


class _Refused(Exception):
    """Raised inside the parser hooks; turned into CorruptCheckpointError by loads."""


def _error(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: {what}; the file is damaged or was not written by ckpt. Restore or "
        f"delete it (for a checkpoint: load an earlier step).", path=source)


def _backslashes_before(data: bytes, pos: int) -> int:
    start = pos
    while pos > 0 and data[pos - 1] == 0x5C:
        pos -= 1
    return start - pos


def _check_depth(data: bytes, max_depth: int, source: str) -> None:
    """Raise if brackets outside strings nest deeper than ``max_depth`` (or do not balance).

    Never recurses, and runs in a few vectorised passes whatever the document's shape: a
    bracket is inside a string when an odd number of unescaped quotes precede it.
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    step = _BRACKET_STEP[raw]
    if np.count_nonzero(step > 0) <= max_depth:
        return  # not even that many opening brackets, strings included
    brackets = np.flatnonzero(step)
    quotes = np.flatnonzero(raw == 0x22)
    if len(quotes):
        # A quote preceded by an odd run of backslashes is escaped (rare: checked one by one).
        maybe = quotes[(quotes > 0) & (raw[np.maximum(quotes - 1, 0)] == 0x5C)].tolist()
        escaped = [q for q in maybe if _backslashes_before(data, q) % 2]
        if escaped:
            quotes = quotes[~np.isin(quotes, escaped)]
        brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]
    depth = np.cumsum(step[brackets], dtype=np.int64)
    if len(depth) and (int(depth.max()) > max_depth or int(depth.min()) < 0
                       or int(depth[-1]) != 0):
        raise _error(source, f"JSON nested deeper than {max_depth} levels (or with "
                             f"unbalanced brackets)")


def _parse_int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"integer of {digits} digits (at most {MAX_INT_DIGITS} are allowed)")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > _MAX_NUMBER_CHARS:
        raise _Refused(f"number literal of {len(text)} characters")
    value = float(text)
    if math.isinf(value):
        raise _Refused(f"number {text[:40]!r} overflows a float")
    return value


def _parse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not JSON (non-finite numbers are written as "
                   f'{{"{FLOAT_TAG}": "nan"|"inf"|"-inf"}})')


def _object(pairs: list[tuple[str, Any]]) -> Any:
    if len(pairs) == 1:
        key, value = pairs[0]
        # dumps escapes every one-member object keyed by a tag, so such an object is always
        # a tag; one with a payload dumps never writes is refused, not read as a plain dict.
        if key == FLOAT_TAG:
            if isinstance(value, str) and value in _NON_FINITE:
                return _NON_FINITE[value]
            raise _Refused(f'{{"{FLOAT_TAG}": {str(value)[:40]!r}}} (the tag holds "nan", '
                           f'"inf" or "-inf")')
        if key == LITERAL_TAG:
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                return {value[0]: value[1]}
            raise _Refused(f'{{"{LITERAL_TAG}": {str(value)[:40]!r}}} (the tag holds '
                           f'[key, value])')
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"duplicate key {key[:80]!r} in one object")
            seen.add(key)
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_int=_parse_int,
                            parse_float=_parse_float, parse_constant=_parse_constant)
_FAST_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_float=_parse_float,
                                 parse_constant=_parse_constant)


def loads(data: bytes | str, source: str, *, max_depth: int = 64,
          max_bytes: int = 64 << 20) -> Any:
    """Parse strict JSON from ``data``; ``source`` names the file in every error."""
    if isinstance(data, str):
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError:
            raise _error(source, "text is not valid Unicode") from None
    else:
        raw = bytes(data)
    if len(raw) > max_bytes:
        raise _error(source, f"{len(raw)} bytes of JSON, more than the {max_bytes} allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _error(source, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    _check_depth(raw, max_depth, source)
    decoder = _DECODER if _LONG_DIGITS in raw.translate(_ONLY_DIGITS) else _FAST_DECODER
    try:
        return decoder.decode(text)
    except _Refused as exc:
        raise _error(source, f"invalid JSON: {exc}") from None
    except json.JSONDecodeError as exc:
        raise _error(source, f"not valid JSON ({exc})") from None
    except (ValueError, RecursionError) as exc:  # defensive: e.g. int conversion limits
        raise _error(source, f"not valid JSON ({type(exc).__name__}: {exc})") from None


def _encode(value: Any) -> Any:
    """``value`` with non-finite floats tagged and tag-shaped literals escaped."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, dict):
        out = {k: _encode(v) for k, v in value.items()}
        if len(out) == 1:
            ((key, inner),) = out.items()
            if key in (FLOAT_TAG, LITERAL_TAG):
                return {LITERAL_TAG: [key, inner]}
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def dumps(obj: Any, *, indent: int | None = None) -> bytes:
    """Strict JSON (UTF-8) of ``obj``; non-finite floats use the documented encoding.

    Raises ``ValueError`` for values JSON cannot hold (``TypeError`` for unknown types, as
    ``json.dumps`` does).
    """
    separators = (",", ":") if indent is None else (",", ": ")
    return json.dumps(_encode(obj), indent=indent, separators=separators,
                      allow_nan=False).encode("utf-8")
