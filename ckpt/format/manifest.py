"""The checkpoint manifest: the JSON document whose existence commits a checkpoint.

See docs/format.md for the normative description. :class:`Manifest` is the parsed,
validated document: it writes itself (:meth:`Manifest.to_json_bytes`, digest first), reads
untrusted bytes through :mod:`ckpt.format._check` (digest, then every MUST of the format,
before any caller allocates or reads a byte on its word), and converts itself to the
metadata that ``torch.distributed.checkpoint``'s planners work with. The records it is made
of, the dtype names and the file and folder names live in :mod:`ckpt.format._schema`.

Since format version 2 the manifest is the *root*: it lists every file, every key (dtype,
shape) and the chunks of tensors saved whole, while the chunks of sharded tensors are in
per-rank parts (:mod:`ckpt.format.part`). A root read alone is not ``complete``; merged
with its parts (:func:`ckpt.format.part.complete_manifest`) it is, and reads like a
version 1 manifest. Version 1 manifests are always complete.

Imports go one way: ``_schema`` <- ``_items`` <- ``_check`` <- ``manifest`` <- ``part``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.errors import CorruptCheckpointError
from ckpt.format import jsonio
from ckpt.format._check import (
    manifest_bytes,
    read_manifest_fields,
)
from ckpt.format.lineage import Lineage
from ckpt.format.span import Span
from ckpt.format._schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Attachment,
    FileRecord,
    ItemLocation,
    PartRecord,
    dtype_from_name,
    step_dirname,
)

__all__ = ["Manifest"]


@dataclass
class Manifest:
    """A parsed, validated manifest. ``tensors`` maps FQN -> {dtype, shape, chunks, sharded}.

    ``sharded``: the tensor's chunks are (also) listed in parts; ``parts``: name -> record
    of each part (format version 2). ``complete``: ``tensors`` lists every chunk (a
    version 1 manifest, a root without sharded tensors, or a root merged with its parts;
    chunks merged from a part carry ``"part": name`` and are not written back by
    :meth:`to_json_bytes`, which always writes the root). ``span``: the version holds one
    node's share of a job-wide checkpoint (:mod:`ckpt.format.span`): its sharded tensors
    may be held only in part; None: a whole checkpoint.
    """

    step: int
    save_id: str
    created_unix: float
    tensors: dict[str, dict[str, Any]]
    objects: dict[str, ItemLocation]
    files: dict[str, FileRecord]
    world_size: int = 1
    layout: dict[str, Any] = field(default_factory=dict)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    writer: dict[str, Any] = field(default_factory=dict)
    planner_data: dict[str, list] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    attachments: dict[str, Attachment] = field(default_factory=dict)
    parts: dict[str, PartRecord] = field(default_factory=dict)
    complete: bool = True
    lineage: Lineage | None = None
    span: Span | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def sharded_keys(self) -> list[str]:
        """Keys of the tensors whose chunks are (also) in parts."""
        return [fqn for fqn, t in self.tensors.items() if t.get("sharded")]

    # -- serialisation ---------------------------------------------------------------------
    def to_json_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "save_id": self.save_id,
            "created_unix": self.created_unix,
            "created": _iso_time(self.created_unix),
            "world_size": self.world_size,
            "layout": self.layout,
            "versions": self.versions,
            "writer": self.writer,
            "user_metadata": self.user_metadata,
            "files": {name: {"size": r.size, "crc32c": f"{r.crc32c:08x}", "rank": r.rank}
                      for name, r in sorted(self.files.items())},
            "tensors": {fqn: _tensor_json(t) for fqn, t in self.tensors.items()},
            "objects": {fqn: loc.to_json() for fqn, loc in self.objects.items()},
            "planner_data": self.planner_data,
        }
        if self.format_version >= 2:
            doc["parts"] = {name: rec.to_json() for name, rec in sorted(self.parts.items())}
        if self.lineage is not None:  # optional: absent in versions written before it
            doc["lineage"] = self.lineage.to_json()
        if self.span is not None:  # optional: only a node's share of a checkpoint has one
            doc["span"] = self.span.to_json()
        if self.attachments:  # optional: manifests without attachments stay as they were
            doc["attachments"] = {name: a.to_json()
                                  for name, a in sorted(self.attachments.items())}
        data = manifest_bytes(doc)
        # Never commit what readers refuse (e.g. user_metadata nested too deep or holding a
        # 400-digit int): fail the save instead of losing the checkpoint.
        try:
            jsonio.loads(data, f"the manifest of step {self.step}")
        except CorruptCheckpointError as exc:
            raise ValueError(
                f"cannot write the manifest of step {self.step}: {exc.args[0].split(';')[0]}; "
                f"keep user_metadata and layout within the JSON rules of docs/format.md") \
                from None
        return data

    @classmethod
    def from_json_bytes(cls, data: bytes, source: str, *,
                        expected_step: int | None = None) -> "Manifest":
        """Check the digest, parse and validate ``data`` (the bytes of ``source``).

        Every problem raises ``CorruptCheckpointError`` (``FormatVersionError`` for a newer
        format) naming ``source``. ``expected_step`` is the step of the folder the manifest
        was read from: a manifest of another step (copied there) is refused.
        """
        fields = read_manifest_fields(data, source)
        fields["complete"] = not any(t["sharded"] for t in fields["tensors"].values())
        manifest = cls(**fields)
        if expected_step is not None and manifest.step != expected_step:
            raise CorruptCheckpointError(
                f"{source}: manifest is of step {manifest.step}, but it lies in the folder of "
                f"step {expected_step} (copied or moved from another checkpoint); load an "
                f"earlier step or put it back in {step_dirname(manifest.step)}/", path=source)
        return manifest

    # -- conversion for torch.distributed.checkpoint ----------------------------------------
    def to_dcp_metadata(self, chunks_by_key: dict[str, list[dict[str, Any]]] | None = None
                        ) -> Metadata:
        """DCP's metadata: every key, with the chunks ``tensors`` lists, or (for a root
        read with some of its parts) those of ``chunks_by_key`` (see
        :func:`ckpt.format.part.merge_chunks`)."""
        sd_md: dict[str, Any] = {}
        storage: dict[MetadataIndex, ItemLocation] = {}
        for fqn, t in self.tensors.items():
            chunks = []
            listed = t["chunks"] if chunks_by_key is None else chunks_by_key[fqn]
            for c in listed:
                chunk = ChunkStorageMetadata(offsets=torch.Size(c["offsets"]),
                                             sizes=torch.Size(c["sizes"]))
                chunks.append(chunk)
                storage[MetadataIndex(fqn, chunk.offsets)] = c["location"]
            sd_md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(t["dtype"], fqn)),
                size=torch.Size(t["shape"]), chunks=chunks)
        for fqn, loc in self.objects.items():
            sd_md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = loc
        planner_data = {k: tuple(v) for k, v in self.planner_data.items()}
        return Metadata(state_dict_metadata=sd_md, planner_data=planner_data,
                        storage_data=storage)


def _tensor_json(t: dict[str, Any]) -> dict[str, Any]:
    """A tensor's record in the root: the chunks it lists itself (not those of parts)."""
    out = {"dtype": t["dtype"], "shape": list(t["shape"]),
           "chunks": [{"offsets": list(c["offsets"]), "sizes": list(c["sizes"]),
                       **c["location"].to_json()} for c in t["chunks"] if "part" not in c]}
    if t.get("sharded"):
        out["sharded"] = True
    return out


def _iso_time(unix: float) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))
    except (ValueError, OverflowError, OSError):
        return ""
