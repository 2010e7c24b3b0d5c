"""Consolidate a sharded checkpoint into full tensors in one process (no process group).

``consolidate(root, step)`` returns the checkpoint as a nested dict of full tensors and
plain values; ``export(root, step, out)`` writes it as a ``.pt`` file loadable with
``torch.load(out, weights_only=True)`` or as ``.safetensors`` (tensors by their flat key;
non-tensor values go to the header's metadata: ``ckpt_objects`` maps each key to its value in
the tagged JSON of :mod:`ckpt.codec`, so ``decode_object(json.dumps(v).encode())`` restores
tuples and bytes exactly).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from ckpt import api
from ckpt.codec import encode_object
from ckpt.manifest import Manifest, dtype_from_name
from ckpt.storage import Storage
from ckpt.store import CheckpointStore

__all__ = ["consolidate", "export"]


def _set_path(root: dict, path: list, value: Any) -> None:
    cur = root
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(cur, list):
            while len(cur) <= key:
                cur.append(None)
            if cur[key] is None:
                cur[key] = [] if isinstance(nxt, int) else {}
            cur = cur[key]
        else:
            cur = cur.setdefault(key, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(cur, list):
        while len(cur) <= last:
            cur.append(None)
        cur[last] = value
    else:
        cur[last] = value


def consolidate(root: str | Storage, step: int | None = None, *, verify: str = "full",
                storage_options: dict[str, Any] | None = None, nested: bool = True,
                ) -> tuple[dict[str, Any], Manifest]:
    """Load checkpoint ``step`` (default: newest committed) as full, unsharded values."""
    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    store = CheckpointStore(storage)
    if step is None:
        manifest = store.latest(check="none")
        if manifest is None:
            from ckpt.errors import CheckpointNotFoundError

            raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url}")
    else:
        manifest = store.read_manifest(step)
    flat: dict[str, Any] = {}
    for fqn, t in manifest.tensors.items():
        flat[fqn] = torch.zeros(t["shape"], dtype=dtype_from_name(t["dtype"], fqn))
    for fqn in manifest.objects:
        flat[fqn] = None
    api.load(flat, storage, manifest, verify=verify, process_group=None)  # objects too
    if not nested:
        return flat, manifest
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = manifest.planner_data.get(fqn) or [fqn]
        _set_path(out, list(path), value)
    return out, manifest


def export(root: str | Storage, step: int | None, out: str, *, verify: str = "full",
           storage_options: dict[str, Any] | None = None,
           progress: Callable[[str], None] | None = None) -> Manifest:
    """Write checkpoint ``step`` to ``out`` (``.pt`` or ``.safetensors``), atomically."""
    fmt = "safetensors" if out.endswith(".safetensors") else "pt"
    if fmt == "pt" and not out.endswith((".pt", ".pth")):
        raise ValueError(f"--out {out!r}: use a .pt/.pth or .safetensors file name")
    state, manifest = consolidate(root, step, verify=verify, storage_options=storage_options,
                                  nested=(fmt == "pt"))
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        if fmt == "pt":
            torch.save(state, tmp)
        else:
            from safetensors.torch import save_file

            tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
            objects = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            meta = {"ckpt_step": str(manifest.step),
                    "ckpt_objects": json.dumps({k: json.loads(encode_object(v, k))
                                                for k, v in objects.items()})}
            save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return manifest
