"""The checkpoint-interval grammar: ``"auto"``, a step count or a duration.

:meth:`Interval.parse` is the one parser of interval strings: the trainer's config,
``CheckpointManager(cadence=...)`` and :func:`ckpt.cadence.policies.parse_interval` all go through it.
Durations are :func:`ckpt.units.parse_duration`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckpt.units import parse_duration, split_duration

__all__ = ["Interval", "INTERVAL_FORMS"]

INTERVAL_FORMS = ("'auto', a whole number of steps such as '50', or a duration such as "
                  "'500ms', '30sec', '5m', '1.5h', '1d'")
"""The accepted checkpoint-interval spellings, as error messages and docs state them."""


@dataclass(frozen=True)
class Interval:
    """A parsed checkpoint interval: ``kind`` is ``"auto"``, ``"steps"`` (``steps`` set) or
    ``"seconds"`` (``seconds`` set). :meth:`parse` is the one parser of interval strings;
    :func:`ckpt.cadence.policies.parse_interval` turns one into its policy."""

    kind: str
    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str | int) -> "Interval":
        """``"auto"``; a whole number of steps >= 1 (``"50"``, or the int ``50`` from TOML); or
        a duration > 0 with a unit (``"500ms"``, ``"30sec"``, ``"5m"``, ``"1.5h"``, ``"1d"``;
        see :func:`~ckpt.units.parse_duration`). Case and surrounding spaces do not matter.
        Raises ``ValueError`` naming the value and the accepted forms."""
        if isinstance(text, bool):
            raise ValueError(f"invalid checkpoint interval {text!r}: pass {INTERVAL_FORMS}")
        raw = str(text).strip()
        if raw.lower() == "auto":
            return cls("auto")
        if re.fullmatch(r"[0-9]+", raw):
            if int(raw) < 1:
                raise ValueError(f"invalid checkpoint interval {text!r}: a step count must be >= 1; "
                                 f"pass {INTERVAL_FORMS}")
            return cls("steps", steps=int(raw))
        parts = split_duration(raw)
        if parts is not None and parts[1]:  # a bare number means steps, never seconds
            seconds = parse_duration(raw)
            if seconds > 0:
                return cls("seconds", seconds=seconds)
        raise ValueError(f"invalid checkpoint interval {text!r}: pass {INTERVAL_FORMS}")
