"""Consolidate a sharded checkpoint into full tensors in one process (no process group).

``consolidate(root, step)`` returns the checkpoint as a nested dict of full tensors and
plain values; ``export(root, step, out)`` writes it as a ``.pt`` file loadable with
``torch.load(out, weights_only=True)`` or as ``.safetensors`` (tensors by their flat key;
non-tensor values go to the header's metadata: ``ckpt_objects`` maps each key to its value in
the tagged JSON of :mod:`ckpt.codec`, so ``decode_object(json.dumps(v).encode())`` restores
tuples and bytes exactly).

Nothing is allocated on the manifest's word alone: the manifest is validated when read
(chunks tile each tensor, items lie inside their files and share no bytes) and the data
files' sizes on storage are checked against it before any tensor is created, so the memory
taken is bounded by the bytes actually present. Planner paths build plain dicts and lists
without padding; paths that collide are a ``CorruptCheckpointError``.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

import torch

from ckpt import api, jsonio
from ckpt.codec import encode_object
from ckpt.errors import CorruptCheckpointError
from ckpt.manifest import Manifest, dtype_from_name, step_dirname
from ckpt.storage import Storage
from ckpt.store import CheckpointStore

__all__ = ["consolidate", "export"]


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
    # Sizes on storage first: the tensors below are as large as the manifest says, and the
    # manifest's claims are only bounded by files that really hold that many bytes.
    store.verify_manifest(manifest, full=False)
    flat: dict[str, Any] = {}
    for fqn, t in manifest.tensors.items():
        flat[fqn] = torch.zeros(t["shape"], dtype=dtype_from_name(t["dtype"], fqn))
    for fqn in manifest.objects:
        flat[fqn] = None
    api.load(flat, storage, manifest, verify=verify, process_group=None)  # objects too
    if not nested:
        return flat, manifest
    source = storage.describe(step_dirname(manifest.step))
    out = _Node()
    for fqn, value in flat.items():
        _set_path(out, list(manifest.planner_data.get(fqn) or [fqn]), value, fqn, source)
    return _finish(out), manifest


def export(root: str | Storage, step: int | None, out: str, *, verify: str = "full",
           storage_options: dict[str, Any] | None = None,
           progress: Callable[[str], None] | None = None) -> Manifest:
    """Write checkpoint ``step`` to ``out`` (``.pt`` or ``.safetensors``), atomically."""
    fmt = "safetensors" if out.endswith(".safetensors") else "pt"
    if fmt == "pt" and not out.endswith((".pt", ".pth")):
        raise ValueError(f"--out {out!r}: use a .pt/.pth or .safetensors file name")
    state, manifest = consolidate(root, step, verify=verify, storage_options=storage_options,
                                  nested=(fmt == "pt"))
    # A fresh temporary name, created exclusively and never through a link, renamed over
    # ``out`` (a link planted at ``out`` is replaced, not followed).
    tmp = f"{out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            if fmt == "pt":
                torch.save(state, f)
            else:
                from safetensors.torch import save

                tensors = {k: v.contiguous() for k, v in state.items()
                           if isinstance(v, torch.Tensor)}
                # One JSON object of the codec's (strict) encodings, joined as they are.
                objects = b",".join(jsonio.dumps(k) + b":" + encode_object(v, k)
                                    for k, v in state.items() if not isinstance(v, torch.Tensor))
                meta = {"ckpt_step": str(manifest.step),
                        "ckpt_objects": "{" + objects.decode("utf-8") + "}"}
                f.write(save(tensors, metadata=meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return manifest
