"""A Hugging Face-style folder: ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` above
``max_shard_bytes``, plus the checkpoint's attachments (``config.json``, tokenizer files),
so ``AutoModelForCausalLM.from_pretrained(out)`` loads it.

``from_pretrained`` needs ``config.json``: :func:`check_hf_config` refuses a checkpoint
without one (unless the caller asks for the weights alone). A checkpoint whose model names
its weights otherwise than the Hugging Face class does carries ``hf_export.json``
(:data:`HF_EXPORT_NAME`): ``{"select": PREFIX, "names": {key: Hugging Face key}}``, read by
:func:`read_hf_names`; it is not copied into the folder. A key may name a list of ``n``
Hugging Face keys instead: its tensor is then ``n`` tensors stacked on the first dimension
(``[n, ...]``, e.g. a mixture of experts' stacked expert weights), and the ``i``-th name gets
``tensor[i]`` (the per-expert ``experts.{i}.w1.weight`` of Mixtral's layout). A model no
Hugging Face class can hold carries ``{"select": PREFIX, "refused": ONE LINE}`` instead:
an hf export is then refused with that line (why, and the fix), or with ``--no-config``
writes the selection's weights under their own names.

The folder is built in a fresh temporary folder beside ``out`` and renamed into place, so
a failure never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import uuid
from typing import Any, Iterable, Sequence

import torch

from ckpt.export._files import check_out_dir
from ckpt.format import jsonio
from ckpt.storage import fsync_dir, write_new_file

__all__ = ["HF_WEIGHTS_NAME", "HF_INDEX_NAME", "HF_CONFIG_NAME", "HF_EXPORT_NAME",
           "check_hf_attachment_names", "check_hf_config", "read_hf_names", "rename_keys",
           "write_hf_folder"]

HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
HF_CONFIG_NAME = "config.json"
HF_EXPORT_NAME = "hf_export.json"
_HF_SHARD_RE = re.compile(r"^model-\d{5,}-of-\d{5,}\.safetensors$")


def check_hf_attachment_names(names: Iterable[str]) -> None:
    """Refuse attachments that would take the name of an exported weights file."""
    for name in names:
        if name in (HF_WEIGHTS_NAME, HF_INDEX_NAME) or _HF_SHARD_RE.match(name):
            raise ValueError(f"attachment {name!r} has the name of an exported weights file; "
                             f"export it with --attachments DIR to another folder instead")


def check_hf_config(names: Iterable[str], source: str, no_config: bool) -> None:
    """Refuse a folder ``from_pretrained`` cannot load: no ``config.json`` among the
    attachments ``names`` of checkpoint ``source``, unless ``no_config``."""
    if no_config or HF_CONFIG_NAME in names:
        return
    raise ValueError(f"{source} has no {HF_CONFIG_NAME} attachment, so from_pretrained "
                     f"could not load the folder (\"Unrecognized model\"); save the model's "
                     f"config with the checkpoint (attachments={{'{HF_CONFIG_NAME}': ...}}), or "
                     f"pass --no-config (no_config=True) to export the weights alone")


def _normalize(prefixes: Sequence[str]) -> list[str]:
    return sorted(p if p.endswith(".") else p + "." for p in prefixes)


def read_hf_names(attached: dict[str, bytes], select: Sequence[str] | None, source: str,
                  no_config: bool = False
                  ) -> tuple[Sequence[str] | None, dict[str, str | list[str]] | None]:
    """The selection and the renaming an hf export of checkpoint ``source`` applies.

    Without ``hf_export.json`` among ``attached``: ``(select, None)``. With it, its prefix
    is the selection when ``select`` is None, and its names apply when the selection is
    that prefix (another selection keeps the keys as they are). When it says the model has
    no Hugging Face class (``refused``), ``ValueError`` with its line, unless ``no_config``
    (the weights alone, under their own names). ``ValueError`` naming the attachment and
    field when it is malformed (it comes from storage: untrusted).
    """
    data = attached.get(HF_EXPORT_NAME)
    if data is None:
        return select, None
    where = f"{source} attachment {HF_EXPORT_NAME}"
    doc = jsonio.loads(data, where)
    prefix = doc.get("select") if isinstance(doc, dict) else None
    names = doc.get("names") if isinstance(doc, dict) else None
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise ValueError(f"{where}: 'select' must be a key prefix such as 'app.model.'; "
                         f"export with --select and --no-config, or fix the attachment")
    if "refused" in doc:
        refused = doc["refused"]
        if not isinstance(refused, str) or not refused.strip() or "\n" in refused:
            raise ValueError(f"{where}: 'refused' must be one line saying why; export with "
                             f"--select and --no-config, or fix the attachment")
        if not no_config:
            raise ValueError(f"{source} has no Hugging Face architecture: {refused}")
        return (select if select is not None else [prefix]), None

    def named(v: Any) -> bool:
        return isinstance(v, str) and bool(v)

    if not isinstance(names, dict) or not all(
            named(v) or isinstance(v, list) and v and all(map(named, v))
            for v in names.values()):
        raise ValueError(f"{where}: 'names' must map each key to a non-empty name (or a "
                         f"non-empty list of names, one per slice of its first dimension); "
                         f"export with --select and --no-config, or fix the attachment")
    flat = [n for v in names.values() for n in ([v] if isinstance(v, str) else v)]
    if len(set(flat)) != len(flat):
        raise ValueError(f"{where}: 'names' gives two tensors one name; fix the attachment")
    if select is None:
        return [prefix], names
    return select, (names if _normalize(select) == _normalize([prefix]) else None)


def rename_keys(tensors: dict[str, Any], names: dict[str, str | list[str]], source: str,
                shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """``tensors`` under their Hugging Face names; every key must have one. A key named by
    a list of ``n`` names holds ``n`` tensors stacked on its first dimension: each name
    gets its slice (a copy: safetensors refuses tensors that share memory). ``shapes``
    (the keys' global shapes, when ``tensors`` holds something else: checking before the
    tensors are read) or the tensors' own shapes must have that first dimension."""
    unnamed = [k for k in tensors if k not in names]
    if unnamed:
        raise ValueError(f"{source} attachment {HF_EXPORT_NAME} names no Hugging Face key "
                         f"for {unnamed[0]!r} ({len(unnamed)} key(s) unnamed); fix the "
                         f"attachment, or export another --select")
    out: dict[str, Any] = {}
    for key, value in tensors.items():
        name = names[key]
        if isinstance(name, str):
            out[name] = value
            continue
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else \
            (shapes or {}).get(key)
        if shape is not None and (not shape or shape[0] != len(name)):
            raise ValueError(f"{source} attachment {HF_EXPORT_NAME} splits {key!r} into "
                             f"{len(name)} tensors, but its shape is {list(shape)} (the first "
                             f"dimension must be {len(name)}); fix the attachment")
        for i, n in enumerate(name):
            out[n] = value[i].clone() if isinstance(value, torch.Tensor) else value
    return out


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys in order, cut before a tensor that would take a shard over ``max_bytes`` (a
    tensor larger than that gets a shard of its own), as transformers splits them."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _new_file_mode(folder: str) -> int:
    """The permissions a new file of ``folder`` gets (0o666 less the umask), found by
    creating one: ``os.umask`` cannot be read without setting it for every thread."""
    probe = os.path.join(folder, f".mode-{uuid.uuid4().hex[:8]}")
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        return stat.S_IMODE(os.stat(probe).st_mode)
    finally:
        os.unlink(probe)


def write_hf_folder(out: str, tensors: dict[str, torch.Tensor], attachments: dict[str, bytes],
                    max_shard_bytes: int, force: bool) -> list[str]:
    """Build the folder beside ``out`` and rename it into place; returns its file names.

    ``out`` is refused when it exists and is not empty, unless ``force``: then the old
    folder is moved aside, replaced, and removed (put back if the rename fails).
    """
    from safetensors.torch import save_file

    check_out_dir(out, force=force)
    out = os.path.abspath(out)
    tmp = os.path.join(os.path.dirname(out),
                       f".{os.path.basename(out)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    old = None
    try:
        shards = _shards(tensors, max_shard_bytes)
        n = len(shards)
        names = [HF_WEIGHTS_NAME] if n == 1 else \
            [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map: dict[str, str] = {}
        mode = _new_file_mode(tmp)
        for name, keys in zip(names, shards):
            path = os.path.join(tmp, name)
            save_file({k: tensors[k].contiguous() for k in keys}, path,
                      metadata={"format": "pt"})
            # safetensors writes a private temporary file (0o600) and renames it: give the
            # shard the permissions the index and attachments get.
            os.chmod(path, mode)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            weight_map.update((k, name) for k in keys)
        if n > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            write_new_file(os.path.join(tmp, HF_INDEX_NAME),
                           json.dumps(index, indent=2).encode() + b"\n")
            names.append(HF_INDEX_NAME)
        for name, data in attachments.items():
            write_new_file(os.path.join(tmp, name), data)
        fsync_dir(tmp)
        # Into place: a new or empty folder is replaced in one rename; with --force a
        # non-empty one is moved aside first and removed after.
        check_out_dir(out, force=force)
        if os.path.isdir(out) and os.listdir(out):
            old = f"{tmp}.old"
            os.rename(out, old)
        try:
            os.replace(tmp, out)
        except OSError:
            if old is not None:  # put the replaced folder back
                os.rename(old, out)
                old = None
            raise
        fsync_dir(os.path.dirname(out))
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return names + sorted(attachments)
