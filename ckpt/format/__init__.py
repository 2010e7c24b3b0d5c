"""What lies on storage: the manifest, its parts, records and names, strict JSON, values,
checksums.

Nothing here reads or writes storage. ``manifest`` holds :class:`Manifest` (the root
document whose existence commits a checkpoint; untrusted bytes are checked by ``_check``
against every MUST of docs/format.md before anything trusts them), ``part`` the per-rank
:class:`Part` that holds the chunks of sharded tensors (format version 2), ``_schema`` the
records, dtype names and file names they are made of, ``_items`` the per-item checks they
share, ``coverage`` the linear check that chunks tile a tensor, ``lineage`` the run a
version comes from, ``span`` the share of a job-wide checkpoint a version holds, ``jsonio``
the strict, bounded JSON of every file the store writes, ``codec`` the pickle-free encoding
of non-tensor values, ``checksums`` CRC32C.
"""

from ckpt.format import codec, jsonio
from ckpt.format._check import MAX_MANIFEST_BYTES
from ckpt.format._schema import (
    DTYPE_NAMES,
    LEGACY_MARKER_NAME,
    LEGACY_ROLLED_NAME,
    MANIFEST_NAME,
    MAX_ATTACHMENT_BYTES,
    Attachment,
    FileRecord,
    ItemLocation,
    PartRecord,
    attachment_file,
    check_attachment_name,
    damaged_manifest_name,
    data_file_id,
    data_file_name,
    dtype_from_name,
    dtype_name,
    fenced_id,
    fenced_name,
    is_damaged_manifest,
    is_packed,
    marker_id,
    marker_name,
    parse_step_dirname,
    part_name,
    rolled_back_id,
    rolled_back_name,
    step_dirname,
    step_file,
)
from ckpt.format.checksums import crc32c_combine, crc32c_of
from ckpt.format.codec import decode_object, encode_object
from ckpt.format.coverage import coverage_problem
from ckpt.format.lineage import Lineage, new_run_id, parent_of, parse_lineage
from ckpt.format.manifest import Manifest
from ckpt.format.part import MAX_PART_BYTES, Part, complete_manifest, merge_chunks, part_sha256
from ckpt.format.span import Span

__all__ = [
    "Manifest", "FileRecord", "ItemLocation", "Attachment", "PartRecord", "Part", "part_name",
    "part_sha256", "merge_chunks", "complete_manifest", "MANIFEST_NAME", "MAX_PART_BYTES",
    "MAX_MANIFEST_BYTES", "coverage_problem", "MAX_ATTACHMENT_BYTES", "DTYPE_NAMES",
    "step_dirname", "parse_step_dirname", "step_file", "data_file_name", "attachment_file",
    "marker_name", "rolled_back_name", "fenced_name", "damaged_manifest_name", "data_file_id",
    "marker_id", "rolled_back_id", "fenced_id", "is_damaged_manifest", "LEGACY_MARKER_NAME",
    "LEGACY_ROLLED_NAME", "check_attachment_name", "dtype_name", "dtype_from_name", "is_packed",
    "crc32c_of", "crc32c_combine", "encode_object", "decode_object", "jsonio", "codec", "Lineage",
    "new_run_id", "parent_of", "parse_lineage", "Span",
]
