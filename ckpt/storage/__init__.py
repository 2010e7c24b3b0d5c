"""Storage: one small interface over fsspec, and everything that knows a backend.

:class:`Storage` (``_storage``) is the one type the rest of ``ckpt`` talks to: it parses a
root's URL (local paths, ``file://``, ``s3://``, ``memory://``), names files in messages,
retries transient errors (``_retry``: which errors, and the one backoff) and turns the
others into errors that name the URL and the fix. It hands the primitives to a backend, one
class per filesystem family:

* ``LocalBackend`` (``_local``): local paths and ``file://``; fsync'd writes renamed into
  place, commit by hard link, no symbolic link followed. Its file helpers
  (``replace_file``, ``write_new_file``, ``fsync_dir``) serve local exports too.
* ``S3Backend`` (``_s3``): ``s3://`` and ``s3a://`` through s3fs; conditional PUTs,
  parallel zero-copy multipart uploads.
* ``FsspecBackend`` (``_base``): ``memory://`` and any other fsspec filesystem;
  exclusive creates and conditional replaces are atomic within one process only.

The interface is ``_base.Backend``; a new filesystem family is a new subclass and a line in
``_storage.open_backend``. Nothing outside this package asks which backend a root is on: it asks
the :class:`Storage` what the root can do (``local_path``, ``has_folders``,
``default_threads``, ``preferred_file_bytes``) or where it is (``Storage.location``).
"""

from ckpt.storage._local import fsync_dir, replace_file, write_new_file
from ckpt.storage._retry import RetryPolicy, backoff_seconds
from ckpt.storage._storage import Storage

__all__ = ["Storage", "RetryPolicy", "backoff_seconds", "replace_file", "write_new_file",
           "fsync_dir"]
