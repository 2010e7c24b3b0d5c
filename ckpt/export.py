"""Consolidate a sharded checkpoint into full tensors in one process (no process group).

``consolidate(root, step)`` returns the checkpoint as a nested dict of full tensors and
plain values; ``export(root, step, out)`` writes it as

* a ``.pt`` file loadable with ``torch.load(out, weights_only=True)``;
* a ``.safetensors`` file (tensors by their flat key; non-tensor values go to the header's
  metadata: ``ckpt_objects`` maps each key to its value in the tagged JSON of
  :mod:`ckpt.codec`, so ``decode_object(json.dumps(v).encode())`` restores tuples and bytes
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
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from typing import Any, Callable, Iterable, Sequence

import torch

from ckpt import api, jsonio
from ckpt.attachments import read_from
from ckpt.codec import encode_object
from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpt.manifest import Manifest, dtype_from_name, step_dirname
from ckpt.plan import parse_size
from ckpt.backends.local import replace_file
from ckpt.storage import Storage
from ckpt.store import CheckpointStore

__all__ = ["consolidate", "export", "select_keys", "parse_dtype", "write_attachments",
           "check_out_dir", "FORMATS", "HF_WEIGHTS_NAME", "HF_INDEX_NAME"]

FORMATS = ("pt", "safetensors", "hf")
HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
_HF_SHARD_RE = re.compile(r"^model-\d{5,}-of-\d{5,}\.safetensors$")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}
_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")


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


# -- options ---------------------------------------------------------------------------------
def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A floating dtype from ``bf16``/``fp16``/``fp32``/``fp64``, ``half``/``float``/
    ``double`` or a full name (``bfloat16``, ``torch.float16`` ...); ``ValueError`` else."""
    if isinstance(value, torch.dtype):
        name = str(value).removeprefix("torch.")
    else:
        name = str(value).strip().lower().removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
    if name not in _FLOAT_DTYPES or not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"--dtype {str(value)[:40]!r}: expected a floating dtype: bf16, fp16, "
                         f"fp32, fp64 or a full name ({', '.join(_FLOAT_DTYPES)})")
    return getattr(torch, name)


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


# -- consolidation ----------------------------------------------------------------------------
def _manifest(storage: Storage, step: int | Manifest | None) -> Manifest:
    if isinstance(step, Manifest):
        return step
    store = CheckpointStore(storage)
    if step is not None:
        return store.read_manifest(step)
    manifest = store.latest(check="none")
    if manifest is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url}")
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
            flat[fqn] = torch.zeros(t["shape"], dtype=dtype_from_name(t["dtype"], fqn))
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
    return (_nest(flat, manifest, source) if nested else flat), manifest


class _ByteCounter:
    """``progress(done, total)`` from byte counts reported by the reader's threads."""

    def __init__(self, progress: Callable[[int, int], None], total: int):
        self.progress, self.total, self.done = progress, total, 0
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            self.progress(self.done, self.total)


def _nest(flat: dict[str, Any], manifest: Manifest, source: str) -> dict[str, Any]:
    """The nested state the flat keys came from (their planner paths)."""
    out = _Node()
    for fqn, value in flat.items():
        _set_path(out, list(manifest.planner_data.get(fqn) or [fqn]), value, fqn, source)
    return _finish(out)


def _cast(flat: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """Floating tensors as ``dtype``, one at a time (each original freed as it goes)."""
    if dtype is None:
        return flat
    for k, v in flat.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype:
            flat[k] = v.to(dtype)
    return flat


# -- writing ----------------------------------------------------------------------------------
def _create(path: str) -> int:
    """A new file, created exclusively and never through a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                   0o644)


def _write_file(path: str, data: bytes) -> None:
    with os.fdopen(_create(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_file(out: str, write: Callable[[Any], None]) -> None:
    """Write ``out`` atomically, never through a planted link (the storage's own way)."""
    replace_file(out, write)


def _check_parent(parent: str) -> None:
    if not os.path.exists(parent):
        raise ValueError(f"output folder {parent} does not exist; create it or choose "
                         f"another --out")
    if not os.path.isdir(parent):
        raise ValueError(f"output folder {parent} is a file, not a folder; choose another "
                         f"--out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output folder {parent} is not writable; fix its permissions or "
                         f"choose another --out")


def check_out_file(out: str) -> None:
    """Refuse an output file that cannot be written, before anything is read."""
    if os.path.isdir(out):
        raise ValueError(f"--out {out} is a folder; name a file in it, such as "
                         f"{os.path.join(out, 'model.safetensors')}")
    _check_parent(os.path.dirname(os.path.abspath(out)))


def check_out_dir(out: str, *, force: bool = False) -> None:
    """Refuse an output folder that cannot be (re)placed, before anything is read."""
    if os.path.islink(out):
        raise ValueError(f"--out {out} is a symbolic link; name a real folder")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; --format hf writes a folder, name a new one")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise FileExistsError(f"--out {out} is a folder that is not empty; pass --force to "
                              f"replace it, or name a new folder")
    _check_parent(os.path.dirname(os.path.abspath(out)))


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


def _check_hf_attachment_names(names: Iterable[str]) -> None:
    for name in names:
        if name in (HF_WEIGHTS_NAME, HF_INDEX_NAME) or _HF_SHARD_RE.match(name):
            raise ValueError(f"attachment {name!r} has the name of an exported weights file; "
                             f"export it with --attachments DIR to another folder instead")


def _write_hf(out: str, tensors: dict[str, torch.Tensor], attachments: dict[str, bytes],
              max_shard_bytes: int, force: bool) -> list[str]:
    """Build the folder beside ``out`` and rename it into place; returns its file names."""
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
        for name, keys in zip(names, shards):
            path = os.path.join(tmp, name)
            save_file({k: tensors[k].contiguous() for k in keys}, path,
                      metadata={"format": "pt"})
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            weight_map.update((k, name) for k in keys)
        if n > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            _write_file(os.path.join(tmp, HF_INDEX_NAME),
                        json.dumps(index, indent=2).encode() + b"\n")
            names.append(HF_INDEX_NAME)
        for name, data in attachments.items():
            _write_file(os.path.join(tmp, name), data)
        _fsync_dir(tmp)
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
        _fsync_dir(os.path.dirname(out))
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return names + sorted(attachments)


def _read_attachments(storage: Storage, manifest: Manifest) -> dict[str, bytes]:
    return {name: read_from(storage, manifest, name) for name in sorted(manifest.attachments)}


def _check_clash(names: Iterable[str], out_dir: str, force: bool) -> None:
    clash = [n for n in names if os.path.lexists(os.path.join(out_dir, n))]
    if clash and not force:
        raise FileExistsError(f"--attachments {out_dir}: {', '.join(clash)} already exist(s); "
                              f"pass --force to overwrite, or choose another folder")


def _write_attachment_files(datas: dict[str, bytes], out_dir: str, force: bool) -> None:
    os.makedirs(out_dir, exist_ok=True)
    _check_clash(datas, out_dir, force)
    for name, data in datas.items():
        _replace_file(os.path.join(out_dir, name), lambda f, d=data: f.write(d))


def write_attachments(storage: Storage, manifest: Manifest, out_dir: str, *,
                      force: bool = False) -> list[str]:
    """Write every attachment of ``manifest`` (each verified) into ``out_dir`` (created if
    missing). Refuses, before writing any, to overwrite an existing file unless ``force``."""
    datas = _read_attachments(storage, manifest)
    _write_attachment_files(datas, out_dir, force)
    return list(datas)


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
           force: bool = False, attachments_dir: str | None = None) -> Manifest:
    """Write checkpoint ``step`` (None: newest committed) to ``out``, atomically.

    ``format``: ``"pt"``, ``"safetensors"`` (default: from ``out``'s suffix) or ``"hf"``
    (``out`` is a folder; refused when it exists and is not empty unless ``force``).
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
    if fmt == "hf":
        _check_hf_attachment_names(manifest.attachments)
        keys = select_keys([*manifest.tensors, *manifest.objects], select,
                           f"step {manifest.step}") if select \
            else {k: k for k in [*manifest.tensors, *manifest.objects]}
        objects = [old for old in keys.values() if old in manifest.objects]
        if objects:
            raise ValueError(f"--format hf holds tensors only, and {objects[0]!r} (of "
                             f"{len(objects)} such keys) is not a tensor; use --select to keep "
                             f"the model's weights, e.g. --select app.model.")
    # Attachments are read (and verified) before any tensor, and written after the weights.
    attached = _read_attachments(storage, manifest) \
        if fmt == "hf" or attachments_dir is not None else {}
    if attachments_dir is not None:
        _check_clash(attached, attachments_dir, force)
    if out is not None:
        _export_weights(storage, manifest, out, fmt, verify=verify, select=select,
                        cast_to=cast_to, attached=attached, max_shard_bytes=max_shard_bytes,
                        force=force, progress=progress)
    if attachments_dir is not None:
        _write_attachment_files(attached, attachments_dir, force)
    return manifest


def _export_weights(storage: Storage, manifest: Manifest, out: str, fmt: str, *, verify: str,
                    select: Sequence[str] | None, cast_to: torch.dtype | None,
                    attached: dict[str, bytes], max_shard_bytes: int, force: bool,
                    progress: Callable[[int, int], None] | None = None) -> None:
    state, manifest = consolidate(storage, manifest, verify=verify, select=select,
                                  nested=False, progress=progress)
    state = _cast(state, cast_to)
    if fmt == "hf":
        _write_hf(out, state, attached, max_shard_bytes, force)
        return
    if fmt == "pt" and not select:
        state = _nest(state, manifest, storage.describe(step_dirname(manifest.step)))

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

    _replace_file(out, write)
