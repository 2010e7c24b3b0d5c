"""Storage backends: one class per filesystem family behind one small interface.

:class:`~ckpt.storage.Storage` is the facade everything else uses; it parses the URL, wraps
each call in the retry policy and turns errors into user-facing ones, and hands the
primitives to the backend :func:`open_backend` picks:

* ``LocalBackend`` (``local.py``): local paths and ``file://``; fsync'd writes renamed into
  place, commit by hard link, no symbolic link followed.
* ``S3Backend`` (``s3.py``): ``s3://`` and ``s3a://`` through s3fs; conditional PUTs,
  parallel zero-copy multipart uploads.
* ``FsspecBackend`` (``base.py``): ``memory://`` and any other fsspec filesystem, through
  generic fsspec calls; exclusive creates and conditional replaces are atomic within one
  process only.

``LocalBackend`` and ``S3Backend`` subclass ``FsspecBackend`` and override only the
primitives they make stronger. The interface is :class:`~ckpt.backends.base.Backend`; a new
filesystem family is a new subclass and a line in :func:`open_backend`.
"""

from __future__ import annotations

from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckpt._retry import RetryPolicy
from ckpt.backends.base import Backend, FsspecBackend
from ckpt.backends.local import LocalBackend
from ckpt.backends.s3 import PROTOCOLS as S3_PROTOCOLS
from ckpt.backends.s3 import S3Backend, open_s3

__all__ = ["Backend", "FsspecBackend", "LocalBackend", "S3Backend", "open_backend"]


def open_backend(url: str, options: dict[str, Any], retry: RetryPolicy) -> Backend:
    """The backend for checkpoint root ``url`` (already normalised by ``Storage``).

    ``options`` are fsspec's ``storage_options``; ``retry`` is the policy the backend's
    multi-request writes use. A URL that cannot be opened (unknown protocol, missing
    package, bad options, no bucket) raises ``ValueError`` naming it."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    is_s3 = protocol in S3_PROTOCOLS
    try:
        fs, root = open_s3(url, options) if is_s3 else fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot open checkpoint root {url!r}: {exc}") from exc
    if is_s3:
        return S3Backend(url, fs, root, retry, options)
    if isinstance(fs, LocalFileSystem):
        return LocalBackend(url, fs, root, retry)
    return FsspecBackend(url, fs, root, retry)
