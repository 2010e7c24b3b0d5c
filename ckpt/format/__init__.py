"""What lies on storage: the manifest, its records and names, strict JSON, values, checksums.

Nothing here reads or writes storage. ``manifest`` holds :class:`Manifest` (the document
whose existence commits a checkpoint; untrusted bytes are checked by ``_check`` against
every MUST of docs/format.md before anything trusts them), ``_schema`` the records, dtype
names and file names it is made of, ``jsonio`` the strict, bounded JSON of every file the
store writes, ``codec`` the pickle-free encoding of non-tensor values, ``checksums`` CRC32C.
"""

from ckpt.format import codec, jsonio
from ckpt.format._check import DIGEST_KEY, MAX_GRID_CELLS, manifest_bytes
from ckpt.format._schema import (
    DTYPE_NAMES,
    FORMAT_DTYPE_NAMES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_ATTACHMENT_BYTES,
    Attachment,
    FileRecord,
    ItemLocation,
    check_attachment_name,
    dtype_from_name,
    dtype_name,
    is_packed,
    parse_step_dirname,
    step_dirname,
)
from ckpt.format.checksums import crc32c_combine, crc32c_of
from ckpt.format.codec import UnsupportedValueError, decode_object, encode_object
from ckpt.format.manifest import Manifest

__all__ = [
    "Manifest", "FileRecord", "ItemLocation", "Attachment",
    "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "DIGEST_KEY", "MAX_GRID_CELLS",
    "MAX_ATTACHMENT_BYTES", "DTYPE_NAMES", "FORMAT_DTYPE_NAMES",
    "manifest_bytes", "step_dirname", "parse_step_dirname", "check_attachment_name",
    "dtype_name", "dtype_from_name", "is_packed",
    "crc32c_of", "crc32c_combine",
    "encode_object", "decode_object", "UnsupportedValueError",
    "jsonio", "codec",
]
