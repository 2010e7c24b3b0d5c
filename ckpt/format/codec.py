"""A JSON encoding for the non-tensor values of a state dict.

Checkpoints never contain pickles: a checkpoint from a stranger must not be able to run code
on load. Non-tensor leaves (step counters, LR-scheduler fields, RNG states of Python's
``random``, config strings) are stored as JSON with a small tagged extension for the Python
types JSON lacks. Decoding only ever builds plain data.

Tags: ``{"__tuple__": [...]}``, ``{"__bytes__": "<base64>"}``, ``{"__float__": "nan"|"inf"|
"-inf"}``, ``{"__dict__": [[key, value], ...]}`` for dicts with non-string keys, and
``{"__dtype__": "float32"}`` / ``{"__device__": "cpu"}`` for torch dtypes and devices.
The JSON itself is read and written by :mod:`ckpt.format.jsonio` (strict; bounded depth and
numbers); non-finite floats use its tag, which is the ``__float__`` above.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from ckpt.format import jsonio

__all__ = ["encode_object", "decode_object", "UnsupportedValueError"]

_TAGS = ("__tuple__", "__bytes__", "__float__", "__dict__", "__dtype__", "__device__")
MAX_OBJECT_DEPTH = 100  # containers nested in one value; JSON depth is at most twice that


class UnsupportedValueError(TypeError):
    """A value in the state dict has no safe (pickle-free) encoding."""


def _to_json(value: Any, where: str, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, str, float)):
        return value  # non-finite floats: jsonio writes them with the __float__ tag
    if isinstance(value, int):
        return int(value)
    if isinstance(value, (tuple, list, dict)) and depth >= MAX_OBJECT_DEPTH:
        raise UnsupportedValueError(
            f"state dict value {where!r} nests containers more than {MAX_OBJECT_DEPTH} deep; "
            f"flatten it (a reader refuses deeper JSON)")
    d = depth + 1
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v, f"{where}[{i}]", d) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_to_json(v, f"{where}[{i}]", d) for i, v in enumerate(value)]
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: _to_json(v, f"{where}.{k}", d) for k, v in value.items()}
        return {"__dict__": [[_to_json(k, f"{where}<key>", d), _to_json(v, f"{where}[{k!r}]", d)]
                             for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "shape", None) == ():
        return _to_json(value.item(), where, depth)  # numpy scalars
    if isinstance(value, torch.Tensor):
        raise UnsupportedValueError(
            f"state dict value {where!r} is a tensor nested inside a non-tensor container; "
            f"put tensors directly in dicts (or lists of tensors) so they are stored as tensors")
    raise UnsupportedValueError(
        f"state dict value {where!r} has type {type(value).__module__}.{type(value).__name__}, "
        f"which cannot be stored without pickle. Return tensors or JSON-like values "
        f"(int, float, str, bool, None, list, tuple, dict, bytes) from state_dict().")


def _bad_tag(tag: str, payload: Any, expected: str) -> ValueError:
    return ValueError(f"{{{tag!r}: {str(payload)[:40]!r}}} is no value the encoder writes "
                      f"(the tag holds {expected})")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        tags = [k for k in value if k in _TAGS]
        if not tags:
            return {k: _from_json(v) for k, v in value.items()}
        # The encoder writes a dict with a tag-named key as "__dict__" pairs, so an object
        # with a tag key is a tag, alone and with the payload it writes; anything else is
        # refused rather than decoded into some other value.
        if len(value) != 1:
            raise ValueError(f"an object with the tag {tags[0]!r} beside other keys is no "
                             f"value the encoder writes")
        (tag, payload), = value.items()
        if tag == "__tuple__":
            if not isinstance(payload, list):
                raise _bad_tag(tag, payload, "a list")
            return tuple(_from_json(v) for v in payload)
        if tag == "__bytes__":
            if not isinstance(payload, str):
                raise _bad_tag(tag, payload, "base64 text")
            return base64.b64decode(payload, validate=True)
        if tag == "__dict__":
            if not isinstance(payload, list) or not all(
                    isinstance(kv, list) and len(kv) == 2 for kv in payload):
                raise _bad_tag(tag, payload, "a list of [key, value] pairs")
            return {_hashable(_from_json(k)): _from_json(v) for k, v in payload}
        if tag == "__dtype__":
            dtype = getattr(torch, payload, None) if isinstance(payload, str) else None
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {str(payload)[:40]!r} in checkpoint object")
            return dtype
        if tag == "__device__":
            if not isinstance(payload, str):
                raise _bad_tag(tag, payload, "a device name")
            return torch.device(payload)
        # "__float__": jsonio turns the valid tags into floats, so one left here is not.
        raise _bad_tag(tag, payload, '"nan", "inf" or "-inf"')
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def encode_object(value: Any, where: str = "<object>") -> bytes:
    """Encode a non-tensor state-dict value as UTF-8 JSON bytes."""
    return jsonio.dumps(_to_json(value, where))


def decode_object(data: bytes, source: str = "checkpoint object") -> Any:
    """Decode bytes made by :func:`encode_object`. Never executes code.

    Raises ``ValueError`` (``CorruptCheckpointError`` for bad JSON, naming ``source``),
    ``TypeError`` or ``RuntimeError`` for input no encoder wrote.
    """
    return _from_json(jsonio.loads(data, source, max_depth=2 * MAX_OBJECT_DEPTH + 4))
