"""Consolidate a sharded checkpoint into full tensors in one process (no process group).

``consolidate(root, step)`` returns the checkpoint as a nested dict of full tensors and
plain values; ``export(root, step, out)`` writes it as

* a ``.pt`` file loadable with ``torch.load(out, weights_only=True)``;
* a ``.safetensors`` file (tensors by their flat key; non-tensor values go to the header's
  metadata: ``ckpt_objects`` maps each key to its value in the tagged JSON of
  :mod:`ckpt.format.codec`, so ``decode_object(json.dumps(v).encode())`` restores tuples and bytes
  exactly);
* a Hugging Face-style folder (``format="hf"``): ``model.safetensors``, or shards
  ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` above
  ``max_shard_size``, plus the checkpoint's attachments (``config.json``, tokenizer files),
  so ``AutoModelForCausalLM.from_pretrained(out)`` loads it.

``select=["app.model."]`` keeps only the keys under those prefixes, with the prefix
stripped, so the result loads into the model as it is (``model.load_state_dict``); a ``.pt``
file then holds that flat dict. ``dtype`` casts floating-point tensors (only those).

Nothing is allocated on the manifest's word alone: the manifest is validated when read
(chunks tile each tensor, items lie inside their files and share no bytes) and the data
files' sizes on storage are checked against it before any tensor is created, so the memory
taken is bounded by the bytes actually present. Planner paths build plain dicts and lists
without padding; paths that collide are a ``CorruptCheckpointError``.

Outputs are written atomically: a file to a fresh temporary name renamed over ``out``; a
folder is built in a fresh temporary folder beside ``out`` and renamed into place, so a
failure never leaves a folder that looks complete.

This module reads the checkpoint and drives the export; what to keep and how to shape it
is :mod:`ckpt.export._select`, the output checks and attachment files
:mod:`ckpt.export._files`, the Hugging Face folder :mod:`ckpt.export._hf` (imports go one
way: those never import this module).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence

import torch

from ckpt.dcp import api, read_from
from ckpt.errors import CheckpointNotFoundError, PartialCheckpointError
from ckpt.export._files import (
    check_no_clash,
    check_out_dir,
    write_attachment_files,
)
from ckpt.export._hf import (
    HF_EXPORT_NAME,
    check_hf_attachment_names,
    check_hf_config,
    read_hf_names,
    rename_keys,
    write_hf_folder,
)
from ckpt.export._select import cast_floats, nest, parse_dtype, select_keys
from ckpt.format import Manifest, dtype_from_name, encode_object, is_packed, jsonio, step_dirname
from ckpt.root import CheckpointStore
from ckpt.storage import Storage, replace_file
from ckpt.units import parse_size

__all__ = ["consolidate", "export", "FORMATS"]

FORMATS = ("pt", "safetensors", "hf")


# -- consolidation ----------------------------------------------------------------------------
def _manifest(storage: Storage, step: int | Manifest | None) -> Manifest:
    """The manifest to export: ``step``'s, or the newest committed. A version that holds
    one node's share of a job-wide checkpoint (its ``span``) is refused: it holds only
    that node's ranks' shards and values, not the job's state."""
    if isinstance(step, Manifest):
        manifest = step
    elif step is not None:
        manifest = CheckpointStore(storage).read_manifest(step)
    else:
        manifest = CheckpointStore(storage).latest(check="none")
        if manifest is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url}")
    if manifest.span is not None:
        raise PartialCheckpointError(
            f"{storage.describe(step_dirname(manifest.step))} holds {manifest.span.describe()}"
            f" (a node-local checkpoint), not a whole one; export a step of the job's "
            f"durable root")
    return manifest


def consolidate(root: str | Storage, step: int | Manifest | None = None, *,
                verify: str = "full", storage_options: dict[str, Any] | None = None,
                nested: bool = True, select: Sequence[str] | None = None,
                progress: Callable[[int, int], None] | None = None,
                ) -> tuple[dict[str, Any], Manifest]:
    """Load checkpoint ``step`` (default: newest committed) as full, unsharded values.

    ``select``: only the keys under these prefixes are read, returned flat with the prefix
    stripped (see :func:`select_keys`); ``nested`` is then ignored. ``progress(done,
    total)``: bytes read so far out of the checkpoint's bytes (at most; a selection reads
    fewer).
    """
    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    manifest = _manifest(storage, step)
    source = storage.describe(step_dirname(manifest.step))
    renamed = None
    if select:
        renamed = select_keys([*manifest.tensors, *manifest.objects], select,
                              f"step {manifest.step}")
        wanted = set(renamed.values())
    # Sizes on storage first: the tensors below are as large as the manifest says, and the
    # manifest's claims are only bounded by files that really hold that many bytes.
    CheckpointStore(storage).verify_manifest(manifest, full=False)
    flat: dict[str, Any] = {}
    for fqn, t in manifest.tensors.items():
        if renamed is None or fqn in wanted:
            shape, dtype = t["shape"], dtype_from_name(t["dtype"], fqn)
            # No fill for an empty tensor: torch has none for float4 ("fill_cpu").
            flat[fqn] = torch.zeros(shape, dtype=dtype) if math.prod(shape) else \
                torch.empty(shape, dtype=dtype)
    for fqn in manifest.objects:
        if renamed is None or fqn in wanted:
            flat[fqn] = None
    # Objects too; with a selection, the keys left out are not read at all.
    on_read = None if progress is None else _ByteCounter(progress, manifest.total_bytes)
    api.load(flat, storage, manifest, verify=verify, process_group=None,
             strict=renamed is None, on_bytes_read=on_read)
    if progress is not None:
        progress(manifest.total_bytes, manifest.total_bytes)
    if renamed is not None:
        return {new: flat[old] for new, old in renamed.items()}, manifest
    return (nest(flat, manifest.planner_data, source) if nested else flat), manifest


class _ByteCounter:
    """``progress(done, total)`` from byte counts reported by the reader's threads."""

    def __init__(self, progress: Callable[[int, int], None], total: int):
        self.progress, self.total, self.done = progress, total, 0
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            self.progress(self.done, self.total)


# -- exporting ---------------------------------------------------------------------------------
def _read_attachments(storage: Storage, manifest: Manifest) -> dict[str, bytes]:
    return {name: read_from(storage, manifest, name) for name in sorted(manifest.attachments)}


def _format_of(out: str, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
        if fmt == "safetensors" and not out.endswith(".safetensors") or \
                fmt == "pt" and not out.endswith((".pt", ".pth")):
            raise ValueError(f"--out {out!r} does not end in .{fmt if fmt != 'pt' else 'pt/.pth'}"
                             f" (--format {fmt})")
        return fmt
    if out.endswith(".safetensors"):
        return "safetensors"
    if out.endswith((".pt", ".pth")):
        return "pt"
    raise ValueError(f"--out {out!r}: use a .pt/.pth or .safetensors file name, or --format hf "
                     f"with a folder")


def export(root: str | Storage, step: int | None, out: str | None, *, verify: str = "full",
           storage_options: dict[str, Any] | None = None,
           progress: Callable[[int, int], None] | None = None,
           select: Sequence[str] | None = None, dtype: str | torch.dtype | None = None,
           format: str | None = None, max_shard_size: str | int = "5GB",
           force: bool = False, attachments_dir: str | None = None,
           no_config: bool = False) -> Manifest:
    """Write checkpoint ``step`` (None: newest committed) to ``out``, atomically.

    ``format``: ``"pt"``, ``"safetensors"`` (default: from ``out``'s suffix) or ``"hf"``
    (``out`` is a folder; refused when it exists and is not empty unless ``force``, and
    when the checkpoint has no ``config.json`` attachment unless ``no_config``; a
    checkpoint's ``hf_export.json`` attachment gives the default selection and the
    Hugging Face names of the weights, see :mod:`ckpt.export._hf`).
    ``select``: key prefixes to keep, stripped (:func:`select_keys`); ``dtype``: cast
    floating tensors (``"bf16"``, ``torch.float16`` ...). ``max_shard_size`` (hf only): the
    largest shard, e.g. ``"5GB"`` (powers of 1000) or ``"512MiB"``. ``attachments_dir``:
    also write the checkpoint's attachments into that folder. ``out`` may be None when
    only attachments are wanted. ``progress(done, total)``: bytes read (as for
    :func:`consolidate`).
    """
    if out is None and attachments_dir is None:
        raise ValueError("nothing to export: give --out, --attachments DIR, or both")
    fmt = None if out is None else ("hf" if format == "hf" else _format_of(out, format))
    cast_to = None if dtype is None else parse_dtype(dtype)
    max_shard_bytes = parse_size(max_shard_size) if isinstance(max_shard_size, str) \
        else int(max_shard_size)
    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-size {max_shard_size!r} must be at least 1 byte")
    if fmt == "hf":
        check_out_dir(out, force=force)
    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    manifest = _manifest(storage, step)
    source = f"step {manifest.step}"
    if fmt == "hf":
        check_hf_attachment_names(manifest.attachments)
    # Attachments are read (and verified) before any tensor, and written after the weights.
    attached = _read_attachments(storage, manifest) \
        if fmt == "hf" or attachments_dir is not None else {}
    names = None
    if fmt == "hf":
        # A model's own reason to have no Hugging Face class first, then config.json's.
        select, names = read_hf_names(attached, select, source, no_config)
        check_hf_config(manifest.attachments, source, no_config)
        keys = select_keys([*manifest.tensors, *manifest.objects], select,
                           f"step {manifest.step}") if select \
            else {k: k for k in [*manifest.tensors, *manifest.objects]}
        objects = [old for old in keys.values() if old in manifest.objects]
        if objects:
            raise ValueError(f"--format hf holds tensors only, and {objects[0]!r} (of "
                             f"{len(objects)} such keys) is not a tensor; use --select to keep "
                             f"the model's weights, e.g. --select app.model.")
        if names is not None:  # every key named (and split to fit), before anything is read
            rename_keys(keys, names, source, shapes={
                new: tuple(manifest.tensors[old]["shape"]) for new, old in keys.items()})
    if attachments_dir is not None:
        check_no_clash(attached, attachments_dir, force)
    if out is not None:
        # The names file says how to export; it is not part of the Hugging Face folder.
        folder_files = {k: v for k, v in attached.items() if k != HF_EXPORT_NAME}
        _export_weights(storage, manifest, out, fmt, verify=verify, select=select,
                        cast_to=cast_to, attached=folder_files,
                        max_shard_bytes=max_shard_bytes, force=force, progress=progress,
                        names=names)
    if attachments_dir is not None:
        write_attachment_files(attached, attachments_dir, force)
    return manifest


def _check_safetensors_shapes(state: dict[str, Any]) -> None:
    """safetensors stores float4 as 4-bit values (a shape with twice the last dimension),
    so a 0-dimensional packed tensor (two values in no dimension) has no shape there."""
    scalars = [k for k, v in state.items()
               if isinstance(v, torch.Tensor) and v.dim() == 0 and is_packed(v.dtype)]
    if scalars:
        raise ValueError(f"safetensors cannot hold a 0-dimensional {state[scalars[0]].dtype} "
                         f"tensor ({', '.join(map(repr, scalars[:10]))}); export to a .pt file, "
                         f"or leave these keys out with --select")


def _export_weights(storage: Storage, manifest: Manifest, out: str, fmt: str, *, verify: str,
                    select: Sequence[str] | None, cast_to: torch.dtype | None,
                    attached: dict[str, bytes], max_shard_bytes: int, force: bool,
                    progress: Callable[[int, int], None] | None = None,
                    names: dict[str, str | list[str]] | None = None) -> None:
    state, manifest = consolidate(storage, manifest, verify=verify, select=select,
                                  nested=False, progress=progress)
    state = cast_floats(state, cast_to)
    if names is not None:
        state = rename_keys(state, names, f"step {manifest.step}")
    if fmt in ("safetensors", "hf"):
        _check_safetensors_shapes(state)
    if fmt == "hf":
        write_hf_folder(out, state, attached, max_shard_bytes, force)
        return
    if fmt == "pt" and not select:
        state = nest(state, manifest.planner_data,
                     storage.describe(step_dirname(manifest.step)))

    def write(f) -> None:
        if fmt == "pt":
            torch.save(state, f)
            return
        from safetensors.torch import save

        tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
        # One JSON object of the codec's (strict) encodings, joined as they are.
        objects = b",".join(jsonio.dumps(k) + b":" + encode_object(v, k)
                            for k, v in state.items() if not isinstance(v, torch.Tensor))
        meta = {"format": "pt", "ckpt_step": str(manifest.step),
                "ckpt_objects": "{" + objects.decode("utf-8") + "}"}
        f.write(save(tensors, metadata=meta))

    replace_file(out, write)
