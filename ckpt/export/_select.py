"""What an export keeps and how it shapes it: key selection, dtype casts, nesting.

``select_keys`` keeps the keys under some prefixes (stripped), ``parse_dtype`` and
``cast_floats`` turn floating tensors into one dtype, and ``nest`` rebuilds the nested state
a flat checkpoint came from out of its planner paths: plain dicts and lists, without
padding; paths that collide are a ``CorruptCheckpointError``. Nothing here reads storage.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from ckpt.errors import CorruptCheckpointError
from ckpt.format import DTYPE_NAMES, is_packed

__all__ = ["parse_dtype", "select_keys", "cast_floats", "nest"]

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}
# What a checkpoint can hold and is floating-point (complex is not cast), less the packed
# dtypes, to which nothing converts.
_FLOAT_DTYPES = tuple(n for n in DTYPE_NAMES if getattr(torch, n).is_floating_point
                      and not is_packed(getattr(torch, n)))


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A floating dtype from ``bf16``/``fp16``/``fp32``/``fp64``, ``half``/``float``/
    ``double`` or a full name (``bfloat16``, ``torch.float16`` ...); ``ValueError`` else."""
    if isinstance(value, torch.dtype):
        name = str(value).removeprefix("torch.")
    else:
        name = str(value).strip().lower().removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
    if name not in _FLOAT_DTYPES:
        raise ValueError(f"--dtype {str(value)[:40]!r}: expected a floating dtype: bf16, fp16, "
                         f"fp32, fp64 or a full name ({', '.join(_FLOAT_DTYPES)})")
    return getattr(torch, name)


def cast_floats(flat: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """Floating tensors as ``dtype``, one at a time (each original freed as it goes).
    Packed tensors (``float4_e2m1fn_x2``) stay as they are: torch converts them to nothing."""
    if dtype is None:
        return flat
    for k, v in flat.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype \
                and not is_packed(v.dtype):
            flat[k] = v.to(dtype)
    return flat


def _prefix_groups(keys: Iterable[str]) -> str:
    groups = sorted({".".join(k.split(".")[:2]) + ("." if k.count(".") >= 2 else "")
                     for k in keys})
    return ", ".join(groups[:12]) + (" ..." if len(groups) > 12 else "")


def select_keys(keys: Iterable[str], prefixes: Sequence[str], source: str = "the checkpoint"
                ) -> dict[str, str]:
    """``{new key: checkpoint key}`` for the keys under ``prefixes``, each prefix stripped.

    A prefix names whole path components: ``app.model`` is ``app.model.``. A key under
    several prefixes loses the longest. ``ValueError`` when a prefix matches no key, or when
    two keys become the same key (naming both).
    """
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    keys = list(keys)
    norm: list[str] = []
    for p in prefixes:
        if not isinstance(p, str) or not p.strip("."):
            raise ValueError(f"--select {str(p)[:100]!r}: give a key prefix such as 'app.model.'")
        norm.append(p if p.endswith(".") else p + ".")
    out: dict[str, str] = {}
    used: set[str] = set()
    for key in keys:
        matches = [p for p in norm if key.startswith(p)]
        if not matches:
            continue
        prefix = max(matches, key=len)
        used.add(prefix)
        new = key[len(prefix):]
        if new in out:
            raise ValueError(f"--select: keys {out[new]!r} and {key!r} both become {new!r} once "
                             f"their prefixes are stripped; select only one of them")
        out[new] = key
    for p in norm:
        if p not in used:
            raise ValueError(f"--select {p!r} matches no key of {source}; its keys start with: "
                             f"{_prefix_groups(keys)}")
    return out


# -- nesting -----------------------------------------------------------------------------------
class _Node(dict):
    """A container built from planner paths; becomes a list if its keys are 0..n-1."""


def _set_path(root: _Node, path: list, value: Any, fqn: str, source: str) -> None:
    cur = root
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if key in cur and (last or not isinstance(cur[key], _Node)):
            raise CorruptCheckpointError(
                f"{source}: the planner path {path} of {fqn!r} collides with another key's "
                f"(the manifest is damaged); export with nested=False or load an earlier step",
                path=source)
        if last:
            cur[key] = value
        else:
            cur = cur.setdefault(key, _Node())


def _finish(node: Any) -> Any:
    """Turn _Nodes into dicts, or lists when their keys are exactly 0..n-1 (never padded)."""
    if not isinstance(node, _Node):
        return node
    items = {k: _finish(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items) and set(items) == set(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


def nest(flat: dict[str, Any], planner_data: dict[str, list], source: str) -> dict[str, Any]:
    """The nested state the flat keys came from: each key's value at its planner path in
    ``planner_data`` (a key without one stays a top-level key). ``source`` names the
    checkpoint in errors."""
    out = _Node()
    for fqn, value in flat.items():
        _set_path(out, list(planner_data.get(fqn) or [fqn]), value, fqn, source)
    return _finish(out)
