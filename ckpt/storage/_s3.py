"""S3 (``s3://``, ``s3a://``) through s3fs: conditional writes and parallel multipart uploads.

The commit is a conditional PUT (``If-None-Match: *``); the lease's swap reads the object
with its ETag and writes with ``If-Match`` on it. An object of two parts or more goes up as
a multipart upload whose parts are zero-copy slices of the caller's buffers
(:class:`SegmentsReader`), at most ``max_concurrency`` in flight, each request retried on
its own; a failed upload is aborted. s3fs's and botocore's own retry loops are off for the
clients made here (:func:`open_s3`, :func:`write_client`), so every retry is one of
``RetryPolicy``'s.

Writes (:meth:`S3Backend.write`, and the conditional writes) go through a blocking
botocore client built from the s3fs filesystem's own settings (:func:`write_client`), on
the writer's thread: s3fs runs every request of a process on one event-loop thread, which
then signs (SHA-256 over plain HTTP), checksums and sends every body alone while the other
cores wait. So do whole-object reads (one GET, without s3fs's size request first). Ranged
reads, listings and deletes stay on s3fs.

Size: one backend, S3 through s3fs: conditional writes, bulk deletes, throttling and its
error mapping belong to the same client.
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Sequence

import fsspec

from ckpt.format import crc32c_of
from ckpt.storage._base import FsspecBackend
from ckpt.storage._retry import RetryPolicy, error_code, is_precondition_failed

__all__ = ["S3Backend", "SegmentsReader", "open_s3", "write_client", "split_parts",
           "MIN_PART_BYTES", "MAX_PARTS", "MAX_PUT_BYTES", "DEFAULT_PART_BYTES",
           "DEFAULT_MAX_POOL_CONNECTIONS", "PROTOCOLS"]

log = logging.getLogger("ckpt.storage")
PROTOCOLS = ("s3", "s3a")
MIN_PART_BYTES = 5 << 20  # S3's smallest part (all parts but the last)
MAX_PARTS = 10_000  # S3's most parts per upload
MAX_PUT_BYTES = 5 << 30  # S3's largest single PUT
DEFAULT_PART_BYTES = 32 << 20  # a multipart upload's parts (Storage.write_buffers)

DEFAULT_MAX_POOL_CONNECTIONS = 128  # the blocking client's connections: 16 writers x 8 parts
_REMEMBERED_BYTES = 64 << 10  # records up to this size keep their ETag (the lease: ~0.4 KiB)

_S3_CACHE: dict[tuple, Any] = {}
_S3_CACHE_LOCK = threading.Lock()
_PUT_CLIENTS: dict[tuple[int, int], Any] = {}


def open_s3(url: str, options: dict[str, Any]):
    """``(fs, root)``: an S3FileSystem for ``url`` whose own retries are off (``RetryPolicy``
    does them), and the root as ``bucket/prefix``.

    Listing caches are off too: other processes (ranks, other jobs) write under the same
    root, and a stale listing could make a committed manifest look absent. Instances are
    shared per process and per options, but never with fsspec's global instance cache, so
    a user's own S3FileSystem keeps its settings.
    """
    opts = dict(options)
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    opts["config_kwargs"] = config
    opts.setdefault("use_listings_cache", False)
    key = (os.getpid(), fsspec.utils.tokenize(opts))
    with _S3_CACHE_LOCK:
        fs = _S3_CACHE.get(key)
        if fs is None:
            if opts.get("session") is not None:
                raise ValueError("storage_options['session'] is not supported for checkpoint "
                                 "roots: give credentials as key/secret/token or profile")
            pool = config.get("max_pool_connections", DEFAULT_MAX_POOL_CONNECTIONS)
            if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
                raise ValueError(f"storage_options['config_kwargs']['max_pool_connections'] "
                                 f"must be an integer >= 1 (connections per client), got "
                                 f"{pool!r}")
            fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
            fs.retries = 1  # s3fs's per-call retry loop: one attempt, ours does the rest
            _S3_CACHE[key] = fs
    return fs, fs._strip_protocol(url)


def write_client(fs: Any) -> Any:
    """A blocking botocore S3 client with ``fs``'s endpoint, credentials, profile and client
    configuration (as s3fs builds its own), for the bulk writes; one per filesystem and
    process, shared by its threads (botocore clients are thread-safe).

    Its retries are off like s3fs's (``RetryPolicy`` does them) and its connection pool
    holds ``max_pool_connections`` (from ``config_kwargs``; default
    :data:`DEFAULT_MAX_POOL_CONNECTIONS`), enough for every writer thread and part in
    flight."""
    key = (os.getpid(), id(fs))
    client = _PUT_CLIENTS.get(key)
    if client is not None:
        return client
    with _S3_CACHE_LOCK:
        client = _PUT_CLIENTS.get(key)
        if client is None:
            import botocore
            import botocore.config
            import botocore.session

            client_kwargs = dict(fs.client_kwargs)
            init = {k: v for k, v in (("aws_access_key_id", fs.key),
                                      ("aws_secret_access_key", fs.secret),
                                      ("aws_session_token", fs.token),
                                      ("endpoint_url", fs.endpoint_url))
                    if v is not None and v != client_kwargs.get(k)}
            client_kwargs.setdefault("use_ssl", fs.use_ssl)
            config = dict(fs.config_kwargs)
            config.setdefault("connect_timeout", fs.connect_timeout)
            config.setdefault("read_timeout", fs.read_timeout)
            config.setdefault("max_pool_connections", DEFAULT_MAX_POOL_CONNECTIONS)
            if fs.anon:
                for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
                    init.pop(k, None)
                    client_kwargs.pop(k, None)
                config["signature_version"] = botocore.UNSIGNED
            session = botocore.session.Session(**fs.kwargs)
            client = session.create_client("s3", config=botocore.config.Config(**config),
                                           **init, **client_kwargs)
            _PUT_CLIENTS[key] = client
    return client


def _request_args(fs: Any, client: Any, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with ``fs``'s request-wide extras (``s3_additional_kwargs``, requester-pays)
    that ``method`` accepts, as s3fs adds them to its own calls."""
    extra = {**fs.s3_additional_kwargs, **fs.req_kw, **params}
    if "RequestPayer" in extra and extra["RequestPayer"] is None:
        extra.pop("RequestPayer")
    op = client.meta.method_to_api_mapping[method]
    shape = client.meta.service_model.operation_model(op).input_shape
    valid = set(shape.members) if shape is not None else set()
    return {k: v for k, v in extra.items() if k in valid}


class S3Backend(FsspecBackend):
    """Objects under ``s3://bucket/prefix``. Existence, sizes, ranged reads, listings and
    deletes are s3fs's; writes and whole-object reads are blocking botocore requests made
    here (:func:`write_client`), on the calling thread. There are no folders."""

    shared_across_processes = True

    has_folders = False

    bulk_delete = True

    default_threads = 16
    """Measured on a loopback S3 endpoint: 16 concurrent uploads per rank match a raw
    parallel upload of the same bytes, 4 multipart files reach about half of it."""

    preferred_file_bytes = DEFAULT_PART_BYTES
    """Files of about one part: each is a single PUT and ``default_threads`` of them are in
    flight (multipart completion is slow on some servers, and parallel parts of one file
    add nothing over parallel files)."""

    def __init__(self, url: str, fs: Any, root: str, retry: RetryPolicy,
                 options: dict[str, Any]):
        super().__init__(url, fs, root, retry)
        if not self.root.strip("/"):
            raise ValueError(f"checkpoint root {url!r} names no bucket: use "
                             f"s3://bucket/prefix")
        self.options = options
        # key -> (the small record this backend last wrote there by a conditional write,
        # its ETag): the next swap over that record needs no GET (replace_if_unchanged).
        self._written: dict[str, tuple[bytes, str]] = {}

    @property
    def endpoint(self) -> str:
        opts = self.options
        return (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or "the default AWS endpoint")

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path(rel))
        return bucket, key

    def makedirs(self, rel: str) -> None:
        pass  # prefixes need no creation

    def rmdir(self, rel: str) -> None:
        pass  # a prefix without objects does not exist

    def read(self, rel: str, start: int | None, end: int | None) -> bytes:
        """A whole object is one GET of the blocking client: s3fs asks the object's size
        first (to read a large object in parallel ranges), and on a missing object lists
        its "folder" too, while the whole objects read here are small records (manifests,
        markers, the lease, pins, fence files). Ranges are s3fs's."""
        if start is not None or end is not None:
            return super().read(rel, start, end)
        resp = self._call("get_object", rel)
        with contextlib.closing(resp["Body"]) as body:
            return body.read()

    def read_at_most(self, rel: str, max_bytes: int) -> bytes:
        """One GET, as a whole read, ranged to ``max_bytes + 1`` bytes: a larger object is
        refused by the caller having read no more (an empty object has no range: S3
        answers ``InvalidRange``, read as empty)."""
        try:
            resp = self._call("get_object", rel, Range=f"bytes=0-{max_bytes}")
        except Exception as exc:  # noqa: BLE001 - only an empty object's answer is ours
            if error_code(exc)[0] != "InvalidRange":
                raise
            return b""
        with contextlib.closing(resp["Body"]) as body:
            return body.read()

    def delete_many(self, rels: Sequence[str]) -> None:
        """S3's bulk delete: one request per 1,000 keys."""
        self.fs.rm([self.path(rel) for rel in rels])

    def write(self, rel: str, views: Sequence[memoryview], *, durable: bool, part_bytes: int,
              max_concurrency: int) -> None:
        """A multipart upload of ``part_bytes`` parts (raised to at least 5 MiB, and enough
        to stay within 10,000 parts) for an object of two full parts or more, else one PUT.
        Every object is durable once acknowledged.

        An object under two parts is one PUT even above ``part_bytes``: splitting it would
        add two round trips (create, complete) and a server-side assembly for at most two
        requests in flight, and a writer sizing its files near one part (``dcp_io`` on S3)
        makes many objects slightly above it.

        Requests run on the calling thread through a blocking client (:func:`write_client`),
        parts of one upload on ``max_concurrency`` threads of its own: each thread signs,
        checksums and sends its own bodies, so several writers use several cores instead of
        queueing on s3fs's one event-loop thread."""
        total = sum(v.nbytes for v in views)
        part_bytes = max(part_bytes, MIN_PART_BYTES, -(-total // MAX_PARTS))
        if total >= min(2 * part_bytes, MAX_PUT_BYTES):
            self._multipart_upload(rel, split_parts(views, part_bytes), total, max_concurrency)
            return
        checksum = {}
        if write_client(self.fs).meta.config.request_checksum_calculation != "when_required":
            # The server checks the body against a CRC32C taken here from the buffers
            # themselves, in one pass that releases the GIL; botocore, given one, skips its
            # own CRC32 (another pass over the body through 1 MiB copies).
            crc = crc32c_of(views)
            checksum["ChecksumCRC32C"] = base64.b64encode(crc.to_bytes(4, "big")).decode()
        self.retry.call(f"upload {self.describe(rel)}", lambda: self._call(
            "put_object", rel, Body=SegmentsReader(views), **checksum))

    def _call(self, method: str, rel: str, **params: Any) -> Any:
        """``method`` of the blocking client on ``rel``'s bucket and key, one attempt, with
        the filesystem's extra request arguments (``s3_additional_kwargs``, requester-pays)
        and its errors translated as s3fs translates them."""
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error

        client = write_client(self.fs)
        bucket, key = self._bucket_key(rel)
        try:
            return getattr(client, method)(**_request_args(self.fs, client, method, {
                "Bucket": bucket, "Key": key, **params}))
        except ClientError as exc:
            raise translate_boto_error(exc) from exc

    def _multipart_upload(self, rel: str, parts: list[list[memoryview]], total: int,
                          max_concurrency: int) -> None:
        """Create, upload ``parts`` (at most ``max_concurrency`` at once), complete; abort on
        any failure so no orphan parts remain. Each request is retried on its own."""
        what = f"upload {self.describe(rel)}"
        mpu = self.retry.call(f"{what} (create multipart upload)",
                              lambda: self._call("create_multipart_upload", rel))
        upload_id = mpu["UploadId"]

        def upload(i: int) -> str:
            return self.retry.call(f"{what} part {i + 1}/{len(parts)}", lambda: self._call(
                "upload_part", rel, UploadId=upload_id, PartNumber=i + 1,
                Body=SegmentsReader(parts[i])))["ETag"]

        pool = ThreadPoolExecutor(max(1, min(max_concurrency, len(parts))),
                                  thread_name_prefix="ckpt-s3-part")
        futures: list = []
        try:
            futures = [pool.submit(upload, i) for i in range(len(parts))]
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            etags = [f.result() for f in futures]
            num_complete_calls = 0

            def complete():
                nonlocal num_complete_calls
                num_complete_calls += 1
                try:
                    return self._call("complete_multipart_upload", rel, UploadId=upload_id,
                                          MultipartUpload={"Parts": [
                                              {"PartNumber": i + 1, "ETag": e}
                                              for i, e in enumerate(etags)]})
                except Exception as exc:
                    # A retried complete whose first try landed finds the upload gone.
                    if num_complete_calls > 1 and error_code(exc)[0] == "NoSuchUpload":
                        head = self._call("head_object", rel)
                        if int(head.get("ContentLength", -1)) == total:
                            return None
                    raise

            self.retry.call(f"{what} (complete multipart upload)", complete)
        except BaseException:
            for f in futures:
                f.cancel()
            pool.shutdown(wait=True)  # no part may land after the abort
            try:
                self.retry.call(f"{what} (abort multipart upload)", lambda: self._call(
                    "abort_multipart_upload", rel, UploadId=upload_id))
            except Exception as exc:  # noqa: BLE001 - the upload's own error matters more
                log.warning("could not abort the multipart upload of %s (id %s): %s; a "
                            "bucket lifecycle rule for incomplete uploads will remove its "
                            "parts", self.describe(rel), upload_id, exc)
            raise
        finally:
            pool.shutdown(wait=True)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """A conditional PUT (``If-None-Match: *``), which is the commit itself."""
        try:
            resp = self._call("put_object", rel, Body=data, IfNoneMatch="*")
        except Exception as exc:  # noqa: BLE001
            if not is_precondition_failed(exc):
                raise
            return False
        self._remember(rel, data, resp)
        return True

    def _remember(self, rel: str, data: bytes, resp: Any) -> None:
        etag = resp.get("ETag") if isinstance(resp, dict) else None
        if etag and len(data) <= _REMEMBERED_BYTES:
            self._written[rel] = (bytes(data), etag)

    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes) -> bool:
        """PUT with ``If-Match`` on the ETag of ``expected``: remembered when ``expected``
        is what this backend last wrote there (a lease renewing its own record: one
        request), else read with the object first (GET, then PUT)."""
        known = self._written.pop(rel, None)
        if known is not None and known[0] == expected:
            try:
                resp = self._call("put_object", rel, Body=data, IfMatch=known[1])
            except Exception as exc:  # noqa: BLE001
                if not (is_precondition_failed(exc) or isinstance(exc, FileNotFoundError)):
                    raise  # retried by the caller, which then reads first (nothing known)
                # Changed since we wrote it: decide by what is there now, below.
            else:
                self._remember(rel, data, resp)
                return True
        try:
            resp = self._call("get_object", rel)
            with contextlib.closing(resp["Body"]) as body:
                # Compared with two records: more than the longer of them is neither.
                etag = resp["ETag"]
                current = body.read(max(len(expected), len(data)) + 1)
        except FileNotFoundError as exc:
            if error_code(exc)[0] == "NoSuchBucket":
                raise
            return False
        if current != expected:
            # A retry after a PUT whose answer was lost finds our own data.
            return current == data
        try:
            resp = self._call("put_object", rel, Body=data, IfMatch=etag)
        except Exception as exc:  # noqa: BLE001
            if is_precondition_failed(exc) or isinstance(exc, FileNotFoundError):
                return self.read_or_none(rel, len(data)) == data
            raise
        self._remember(rel, data, resp)
        return True


class SegmentsReader(io.RawIOBase):
    """A seekable read-only file over a list of byte views, without joining them.

    Used as an S3 request body: botocore reads it in small chunks (to checksum and to send)
    and seeks back to retry, so a part is never copied whole.
    """

    def __init__(self, segments: Sequence[memoryview]):
        super().__init__()
        self._segments = list(segments)
        self._starts = []
        total = 0
        for s in self._segments:
            self._starts.append(total)
            total += s.nbytes
        self._size = total
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def __len__(self) -> int:
        return self._size

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = 0
        while n < len(out) and self._pos < self._size:
            i = self._segment_at(self._pos)
            seg, local = self._segments[i], self._pos - self._starts[i]
            take = min(len(out) - n, seg.nbytes - local)
            out[n:n + take] = seg[local:local + take]
            n += take
            self._pos += take
        return n

    def read(self, size: int = -1) -> bytes:
        # One copy, straight from the segments (RawIOBase's read would fill a scratch buffer
        # and copy it again); botocore reads every body three times (signature, checksum,
        # send).
        if size is None or size < 0:
            size = self._size - self._pos
        size = max(0, min(size, self._size - self._pos))
        pieces = []
        while size > 0:
            i = self._segment_at(self._pos)
            seg, local = self._segments[i], self._pos - self._starts[i]
            take = min(size, seg.nbytes - local)
            pieces.append(seg[local:local + take])
            self._pos += take
            size -= take
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)

    def _segment_at(self, pos: int) -> int:
        lo, hi = 0, len(self._starts) - 1
        while lo < hi:  # the last segment starting at or before pos (skipping empty ones)
            mid = (lo + hi + 1) // 2
            if self._starts[mid] <= pos:
                lo = mid
            else:
                hi = mid - 1
        while self._segments[lo].nbytes == 0 or pos >= self._starts[lo] + self._segments[lo].nbytes:
            lo += 1
        return lo


def split_parts(views: Sequence[memoryview], part_bytes: int) -> list[list[memoryview]]:
    """Cut the concatenation of ``views`` into parts of ``part_bytes`` (the last may be
    smaller); each part is a list of zero-copy slices."""
    parts: list[list[memoryview]] = []
    current: list[memoryview] = []
    filled = 0
    for view in views:
        offset = 0
        while offset < view.nbytes:
            take = min(part_bytes - filled, view.nbytes - offset)
            current.append(view[offset:offset + take])
            filled += take
            offset += take
            if filled == part_bytes:
                parts.append(current)
                current, filled = [], 0
    if current:
        parts.append(current)
    return parts
