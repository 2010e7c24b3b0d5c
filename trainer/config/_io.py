"""Configs in and out: a TOML file plus ``--section.key=value`` overrides in, a dict or
TOML text out, the fingerprint of the fields that define the training trajectory, and the
field docs that docs/config.md is generated from.

:func:`load_config` reads a TOML file and then applies overrides written
``--section.key=value`` or ``--section.key value``; values are parsed to the field's type.
Unknown sections and keys are errors with a "did you mean" suggestion; every error is a
:class:`ConfigError` that says where the value was set.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import os
import types
import typing
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from trainer.config._model import ModelConfig
from trainer.config._schema import SECTIONS, Config
from trainer.config._section import ConfigError, coerce, type_name

__all__ = [
    "FINGERPRINT_FIELDS",
    "load_config",
    "config_from_argv",
    "config_from_dict",
    "config_to_dict",
    "config_to_toml",
    "config_fingerprint",
    "parse_overrides",
    "field_docs",
]

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parse_text(text: str, tp: Any, key: str) -> Any:
    """Parse an override's text to annotation ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    try:
        if origin in (typing.Union, types.UnionType):
            if text.strip().lower() in ("none", "null"):
                return None
            (inner,) = [a for a in args if a is not type(None)]
            return _parse_text(text, inner, key)
        if origin is tuple:
            parts = [s.strip() for s in text.strip().strip("[]()").split(",") if s.strip()]
            if len(parts) != len(args):
                raise ValueError(text)
            return tuple(_parse_text(s, a, key) for s, a in zip(parts, args))
        if origin is dict:
            return coerce(json.loads(text), tp, key)
        if tp is bool:
            low = text.strip().lower()
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
            raise ValueError(text)
        if tp is int:
            return int(text.strip().replace("_", ""))
        if tp is float:
            return float(text)
        return text
    except (ValueError, json.JSONDecodeError, RecursionError):
        shown = text if len(text) <= 80 else f"{text[:77]}..."
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {shown!r}", key=key) from None


def _suggest(name: str, options: typing.Iterable[str]) -> str:
    hit = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{hit[0]}'?)" if hit else ""


def _field_of(section: str, key: str) -> dataclasses.Field:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}'{_suggest(section, SECTIONS)}; "
                          f"sections are {', '.join(SECTIONS)}", key=section)
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    if key not in fields:
        dotted = [f"{section}.{k}" for k in fields]
        raise ConfigError(f"unknown key '{section}.{key}'{_suggest(f'{section}.{key}', dotted)}",
                          key=f"{section}.{key}")
    return fields[key]


def _hint(section: str, key: str) -> Any:
    return typing.get_type_hints(SECTIONS[section])[key]


def _build(raw: dict[str, dict[str, Any]], origins: dict[str, str]) -> Config:
    """Construct a Config from ``{section: {key: value}}``; errors say where a value came from."""
    try:
        for section, table in raw.items():
            if not isinstance(table, dict):
                raise ConfigError(f"'{section}' must be a table ([{section}]), got {table!r}",
                                  key=section)
            for key in table:
                _field_of(section, key)
        return Config(**{s: cls(**raw.get(s, {})) for s, cls in SECTIONS.items()})
    except ConfigError as e:
        where = origins.get(e.key or "") or origins.get((e.key or "").split(".")[0], "")
        if where:
            raise ConfigError(f"{e} (set {where})", key=e.key, located=True) from None
        raise


def parse_overrides(args: list[str]) -> list[tuple[str, str | None]]:
    """Split ``["--a.b=1", "--c.d", "2", "--flag"]`` into ``[("a.b","1"), ("c.d","2"),
    ("flag", None)]``. A key without a value is a bare flag (true for booleans)."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r}; overrides look like "
                              "--section.key=value or --section.key value")
        tok = tok[2:]
        if "=" in tok:
            key, value = tok.split("=", 1)
            out.append((key, value))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((tok, args[i + 1]))
            i += 1
        else:
            out.append((tok, None))
        i += 1
    return out


def _apply_override(raw: dict, origins: dict, key: str, text: str | None) -> None:
    parts = key.split(".")
    if len(parts) < 2:
        owners = [f"{s}.{key}" for s, c in SECTIONS.items()
                  if key in {f.name for f in dataclasses.fields(c)}]
        raise ConfigError(f"override '--{key}' needs a section, like --training.steps=100"
                          + (f" (did you mean '--{owners[0]}'?)" if owners else ""), key=key)
    section, name = parts[0], parts[1]
    _field_of(section, name)
    tp = _hint(section, name)
    shown = f"by --{key}" + ("" if text is None else f"={text}")
    table = raw.setdefault(section, {})
    if len(parts) > 2:  # --checkpoint.storage_options.endpoint_url=...
        if typing.get_origin(tp) is not dict or text is None:
            raise ConfigError(f"'{section}.{name}' is not a table; drop the part after it", key=key)
        sub = table.setdefault(name, {})
        for p in parts[2:-1]:
            sub = sub.setdefault(p, {})
        try:
            sub[parts[-1]] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            sub[parts[-1]] = text
        except RecursionError:
            raise ConfigError(f"--{key}: value nested too deeply to read; flatten it",
                              key=key) from None
    elif text is None:
        if tp is not bool:
            raise ConfigError(f"--{key} needs a value ({type_name(tp)})", key=key)
        table[name] = True
    else:
        table[name] = _parse_text(text, tp, f"{section}.{name}")
    origins[f"{section}.{name}"] = shown


def _read_toml(path: str) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict; every way it can be unreadable is a ConfigError
    naming the file and what to do."""
    if os.path.isdir(path):
        raise ConfigError(f"--config {path} is a folder; pass a TOML file such as "
                          f"configs/tiny.toml")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}; pass an existing TOML file "
                          "to --config (see configs/)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); pass a "
                          f"TOML file") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or inline tables nested too deeply "
                          f"to read; flatten them") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}; check that "
                          f"it is a readable file") from None


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read TOML ``path`` (None = defaults only), apply ``overrides`` in order, validate.

    Raises :class:`ConfigError` naming the file and key for unknown sections/keys, bad types
    and invalid values; ``FileNotFoundError`` (as a ConfigError) for a missing file."""
    raw: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if path is not None:
        raw = _read_toml(path)
        for section, table in raw.items():
            if not isinstance(table, dict):
                owners = [s for s, c in SECTIONS.items()
                          if section in {f.name for f in dataclasses.fields(c)}]
                guess = f" (did you mean to put it under [{owners[0]}]?)" if owners else ""
                raise ConfigError(f"{path}: top-level key '{section}': every key belongs to a "
                                  f"section such as [training]{guess}", key=section)
            try:
                for key in table:
                    _field_of(section, key)
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}", key=e.key) from None
            for key in table:
                origins[f"{section}.{key}"] = f"in {path}"
    for key, text in parse_overrides(list(overrides)):
        _apply_override(raw, origins, key, text)
    try:
        return _build(raw, origins)
    except ConfigError as e:
        if path is not None and not e.located:
            raise ConfigError(f"{path}: {e}", key=e.key, located=True) from None
        raise


def config_from_argv(argv: list[str]) -> Config:
    """``--config FILE`` (or ``--config=FILE``) anywhere in ``argv``, the rest are overrides."""
    rest, path, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file path")
            path, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--config="):
            path = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return load_config(path, rest)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Inverse of :func:`config_to_dict` (same validation and errors as a TOML file)."""
    return _build(copy.deepcopy(dict(data)), {})


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """JSON-safe nested dict of every field (tuples become lists)."""
    return _plain(dataclasses.asdict(cfg))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def config_to_toml(cfg: Config) -> str:
    """TOML text that :func:`load_config` reads back to an equal Config (None is omitted)."""
    lines: list[str] = []
    for section, table in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"# {key} = unset (None)" if value is None else
                         f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


FINGERPRINT_FIELDS: dict[str, tuple[str, ...]] = {
    "model": tuple(f.name for f in dataclasses.fields(ModelConfig)),
    "data": ("kind", "path", "token_dtype", "seed", "synthetic_branching", "synthetic_noise"),
    "training": ("seed", "global_batch_size", "seq_len", "lr", "min_lr", "warmup_steps",
                 "lr_decay_steps", "weight_decay", "betas", "eps", "grad_clip",
                 "mixed_precision"),
}
"""Fields that define the training trajectory. Excluded on purpose: training.steps (a run may
be extended), checkpoint/metrics/fault/logging, and the layout (parallel.*, grad_accum_steps,
device, activation_checkpointing*) because checkpoints reshard across layouts (and recomputing
activations changes no value)."""


MOE_KEYS = ("n_experts", "experts_per_token", "moe_every", "n_shared_experts", "moe_ffn_dim",
            "router_aux_loss_coef")
"""The ``[model]`` keys of a mixture of experts: they shape nothing while n_experts = 0."""


def config_fingerprint(cfg: Config) -> str:
    """16 hex chars of SHA-256 over :data:`FINGERPRINT_FIELDS`. Equal fingerprints mean the
    resumed run continues the same problem. ``data.path`` enters by base name only, so a
    dataset mounted elsewhere keeps the fingerprint; ``model.n_kv_heads`` only when it
    differs from ``n_heads`` (a model without grouped-query attention keeps the fingerprint
    it had before the key existed, and so do its checkpoints); the mixture-of-experts keys
    (:data:`MOE_KEYS`) only when ``model.n_experts > 0``, for the same reason."""
    d = config_to_dict(cfg)
    picked = {s: {k: d[s][k] for k in keys} for s, keys in FINGERPRINT_FIELDS.items()}
    picked["data"]["path"] = os.path.basename(picked["data"]["path"])
    if cfg.model.kv_heads == cfg.model.n_heads:
        del picked["model"]["n_kv_heads"]
    if not cfg.model.n_experts:
        for key in MOE_KEYS:
            del picked["model"][key]
    blob = json.dumps(picked, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def field_docs() -> list[tuple[str, str, Any, str]]:
    """``(dotted key, type, default, help)`` for every field, in declaration order."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tp = hints[f.name]
            name = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
            out.append((f"{section}.{f.name}", name, default, f.metadata["help"]))
    return out
