"""Attachments: the small files a job keeps beside its weights (config.json, tokenizer files).

Writing: ``ckpt.save(..., attachments={"config.json": b"...", "tokenizer.json": path})``
(or ``CheckpointManager.save``/``maybe_save``). Names are plain file names (see
:func:`ckpt.format.check_attachment_name`); each value is ``bytes`` or a path to a local
file, at most ``MAX_ATTACHMENT_BYTES`` (64 MiB). The coordinator writes attachment ``name``
of attempt ``ID`` to ``a_{ID}_{name}`` in the checkpoint folder, after the attempt's marker
and before the commit; the manifest lists that file in ``files`` (so it is verified, kept and
deleted with its version, like a data file) and in ``attachments`` with its size and CRC32C
(docs/format.md).

Reading: :func:`read_attachment` and :func:`list_attachments` (no process group); the
bytes' size and CRC32C are checked against the manifest on every read.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Union

from ckpt.errors import (
    CheckpointNotFoundError,
    crc_mismatch_error,
    missing_file_error,
    size_mismatch_error,
)
from ckpt.format import (
    MAX_ATTACHMENT_BYTES,
    Manifest,
    check_attachment_name,
    crc32c_of,
    step_dirname,
)
from ckpt.root import CheckpointStore
from ckpt.storage import Storage

__all__ = [
    "AttachmentValue",
    "check_attachments",
    "attachment_bytes",
    "read_attachment",
    "list_attachments",
    "read_from",
]

AttachmentValue = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]"]


def _too_large(name: str, size: int, what: str) -> ValueError:
    return ValueError(
        f"attachment {name!r} ({what}) is {size} bytes, more than the "
        f"{MAX_ATTACHMENT_BYTES >> 20} MiB an attachment may hold; attachments are for small "
        f"files (configs, tokenizers): save large data as tensors in the state")


def check_attachments(attachments: Mapping[str, AttachmentValue] | None
                      ) -> dict[str, bytes | str]:
    """Validate names, types and in-memory sizes without any I/O; bytes-like values are
    copied (a snapshot), paths stay paths (read when the save writes them).

    Deterministic, so every rank that calls it with the same arguments agrees.
    Raises ``ValueError``/``TypeError`` naming the attachment and the fix.
    """
    if not attachments:
        return {}
    if not isinstance(attachments, Mapping):
        raise TypeError(f"attachments must be a dict of name -> bytes or path, got "
                        f"{type(attachments).__name__}")
    out: dict[str, bytes | str] = {}
    for name, value in attachments.items():
        check_attachment_name(name)
        if isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
            if len(data) > MAX_ATTACHMENT_BYTES:
                raise _too_large(name, len(data), "bytes")
            out[name] = data
        elif isinstance(value, (str, os.PathLike)):
            out[name] = os.fspath(value)
        else:
            raise TypeError(f"attachment {name!r}: expected bytes or a path to a file, got "
                            f"{type(value).__name__}")
    return out


def attachment_bytes(name: str, value: bytes | str) -> bytes:
    """The content of one checked attachment: ``value`` itself, or the file it names (read
    with a bound: a file above the limit is refused without reading it all)."""
    if isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            data = f.read(MAX_ATTACHMENT_BYTES + 1)
    except FileNotFoundError:
        # A ValueError (bad input), which a save reports as is on every rank.
        raise ValueError(f"attachment {name!r}: file {value} does not exist; pass an "
                         f"existing file or the bytes themselves") from None
    except IsADirectoryError:
        raise ValueError(f"attachment {name!r}: {value} is a folder; attach its files one "
                         f"by one") from None
    if len(data) > MAX_ATTACHMENT_BYTES:
        raise _too_large(name, os.path.getsize(value), f"file {value}")
    return data


def read_from(storage: Storage, manifest: Manifest, name: str) -> bytes:
    """Attachment ``name`` of the version ``manifest`` describes, size and CRC32C checked.

    ``FileNotFoundError`` when the version has no such attachment; ``CorruptCheckpointError``
    naming the file when its bytes are missing, short, long or damaged.
    """
    rec = manifest.attachments.get(name)
    d = step_dirname(manifest.step)
    if rec is None:
        have = ", ".join(sorted(manifest.attachments)) or "none"
        raise FileNotFoundError(f"{storage.describe(d)} has no attachment {name!r} "
                                f"(it has: {have})")
    rel = f"{d}/{rec.file}"
    where = storage.describe(rel)
    context = f"attachment {name!r}: "
    try:
        actual_size = storage.size(rel)
    except FileNotFoundError:
        raise missing_file_error(where, context) from None
    if actual_size != rec.size:
        raise size_mismatch_error(where, rec.size, actual_size, context)
    data = storage.read_bytes(rel, 0, rec.size) if rec.size else b""
    crc = crc32c_of([data])
    if len(data) != rec.size or crc != rec.crc32c:
        raise crc_mismatch_error(where, rec.crc32c, crc, context=context)
    return data


def _manifest(root: str | Storage, step: int | None,
              storage_options: dict[str, Any] | None) -> tuple[Storage, Manifest]:

    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    store = CheckpointStore(storage)
    if step is not None:
        return storage, store.read_manifest(step)
    manifest = store.latest(check="none")
    if manifest is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {storage.url}")
    return storage, manifest


def read_attachment(root: str | Storage, step: int | None, name: str, *,
                    storage_options: dict[str, Any] | None = None) -> bytes:
    """The bytes of attachment ``name`` of committed checkpoint ``step`` (None: newest),
    checked against the manifest's size and CRC32C. One process, no process group."""
    storage, manifest = _manifest(root, step, storage_options)
    return read_from(storage, manifest, name)


def list_attachments(root: str | Storage, step: int | None = None, *,
                     storage_options: dict[str, Any] | None = None) -> dict[str, int]:
    """``{name: size in bytes}`` of the attachments of committed checkpoint ``step``
    (None: newest), sorted by name. Reads only the manifest."""
    _, manifest = _manifest(root, step, storage_options)
    return {name: manifest.attachments[name].size for name in sorted(manifest.attachments)}
