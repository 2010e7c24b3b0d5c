"""Quantities with units, as users type them: durations, sizes, bandwidths and fractions.

One grammar (a number, then an optional unit, case-insensitive) behind every such value: the
trainer's config, ``CheckpointManager(cadence=...)`` (through :mod:`ckpt.cadence.interval`),
``ckpt plan`` and ``ckpt export --max-shard-size``. Each parser raises ``ValueError`` naming the
value and the accepted forms.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "DURATION_FORMS",
    "split_duration",
    "parse_duration",
    "parse_size",
    "parse_bandwidth",
    "parse_fraction",
]

_QUANTITY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
                   "d": 86400.0}

DURATION_FORMS = ("a number with an optional unit ms, s or sec, m or min, h, d "
                  "(e.g. '500ms', '30sec', '5m', '1.5h', '1d')")
"""The accepted duration spellings, as error messages and docs state them."""

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_MAX_SIZE_BYTES = 2**63 - 1  # 9.2 EB: any real size fits, and it stays an int64


def _split(text: str, units) -> tuple[float, str] | None:
    """``(number, unit)`` with the unit lower-cased ('' for none), or None if malformed or
    the unit is not one of ``units`` ('' always allowed)."""
    match = _QUANTITY_RE.match(str(text))
    if not match or match.group(2).lower() not in {"", *units}:
        return None
    return float(match.group(1)), match.group(2).lower()


def split_duration(text: str) -> tuple[float, str] | None:
    """``(number, unit)`` of a duration with the unit lower-cased (``""`` when none was
    given), or None when ``text`` is not a duration."""
    return _split(text, _DURATION_UNITS)


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number >= 0 with an optional unit ``ms``, ``s``/``sec``,
    ``m``/``min``, ``h`` or ``d`` (case-insensitive; no unit means seconds), e.g. ``"300"``,
    ``"30sec"``, ``"5m"``, ``"1.5h"``. Raises ``ValueError`` naming the value and the forms."""
    parts = split_duration(text)
    if parts is None:
        raise ValueError(f"invalid duration {text!r}: pass {DURATION_FORMS}")
    number, unit = parts
    return number * _DURATION_UNITS.get(unit, 1.0)


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit B, KB, MB, GB, TB (powers of 1000) or
    KiB, MiB, GiB, TiB (powers of 1024), case-insensitive, e.g. ``"14GB"``, ``"256MiB"``.
    At most 2**63 - 1 bytes (9.2 EB)."""
    parts = _split(text, _SIZE_UNITS)
    if parts is None:
        raise ValueError(
            f"invalid size {text!r}: pass a number with an optional unit B, KB, MB, GB, TB, "
            f"KiB, MiB, GiB or TiB, e.g. '14GB' or '256MiB'"
        )
    value = parts[0] * _SIZE_UNITS[parts[1]]
    num_bytes = int(round(value)) if math.isfinite(value) else None  # '1e400GB' is inf
    if num_bytes is None or num_bytes > _MAX_SIZE_BYTES:
        raise ValueError(f"invalid size {text!r}: too large, the limit is 9.2 EB "
                         f"(2**63 - 1 bytes); pass a size such as '14GB' or '800GiB'")
    return num_bytes


def parse_bandwidth(text: str) -> float:
    """Bytes per second in ``text``: a size per second such as ``"2GB/s"`` or ``"500MiB/s"``
    (the ``/s`` may be omitted). Must be > 0."""
    raw = str(text).strip()
    body = raw[:-2] if raw.lower().endswith("/s") else raw
    try:
        value = parse_size(body)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"invalid bandwidth {text!r}: pass a size per second > 0, e.g. '2GB/s' or '500MiB/s'")
    return float(value)


def parse_fraction(text: str) -> float | None:
    """A fraction in (0, 1] from ``"0.01"`` or ``"1%"``; ``None`` for ``"none"``/``"off"``."""
    raw = str(text).strip()
    if raw.lower() in {"none", "off"}:
        return None
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ValueError(f"invalid overhead budget {text!r}: pass a fraction in (0, 1] such as 0.01, "
                         f"a percentage such as '1%', or 'none'")
    return value
