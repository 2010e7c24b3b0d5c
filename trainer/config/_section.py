"""The building blocks of the config sections: the error type, the field helper, the
section base class that coerces and validates, and the type coercion of values.

Each section type (in :mod:`trainer.config._model`, ``_schema``, ``_parallel`` and
``_checkpoint``) subclasses :class:`Section` and declares its fields with
:func:`config_field`; errors are :class:`ConfigError` whose message starts with the dotted key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import field
from typing import Any, ClassVar

__all__ = ["ConfigError", "Section", "config_field", "fail_key", "coerce", "type_name"]


class ConfigError(ValueError):
    """A config file, override or value is invalid. ``key`` is the dotted key at fault."""

    def __init__(self, message: str, *, key: str | None = None, located: bool = False):
        super().__init__(message)
        self.key = key
        self.located = located  # the message already says where the value was set


def config_field(default: Any, help: str) -> Any:
    """A section field with ``default`` and its one-line ``help`` (the docs' meaning column)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


class Section:
    """Base of every section: coerces field types, then runs the section's ``_validate``."""

    _section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            key = f"{self._section}.{f.name}"
            setattr(self, f.name, coerce(getattr(self, f.name), hints[f.name], key))
        self._validate()

    def _validate(self) -> None:
        pass

    def _fail(self, name: str, problem: str, fix: str = "") -> typing.NoReturn:
        key = f"{self._section}.{name}"
        raise ConfigError(f"{key}: {problem}" + (f"; {fix}" if fix else ""), key=key)

    def _at_least(self, name: str, low: float, what: str = "") -> None:
        value = getattr(self, name)
        if value < low:
            self._fail(name, f"must be >= {low}, got {value!r}", what or f"set it to {low} or more")

    def _choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), choices, n=1)
            self._fail(name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}",
                       f"did you mean {hint[0]!r}?" if hint else "")


def fail_key(key: str, problem: str, fix: str) -> typing.NoReturn:
    """Raise :class:`ConfigError` for dotted ``key``: ``"key: problem; fix"``."""
    raise ConfigError(f"{key}: {problem}; {fix}", key=key)


def type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp).replace("typing.", ""))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; widen int->float and list->tuple."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(value, inner, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}",
                              key=key)
        return tuple(coerce(v, a, key) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}", key=key)
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, int) and not isinstance(value, bool) and key.endswith(
            ".interval"):
        return str(value)  # `interval = 50` in TOML means 50 steps
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r} "
                      f"({type(value).__name__})", key=key)
