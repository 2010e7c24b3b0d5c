"""S3 specifics of ``Storage``, over real HTTP to moto's server (through a recording proxy).

Multipart uploads (parallel, zero-copy, bounded memory, aborted on failure), retries of
transient errors (503 SlowDown, connection resets) counted in ``RetryPolicy.num_retries``,
and the conditional writes the commit and the lease rely on (``If-None-Match: *`` and
``If-Match: <etag>``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
import urllib.parse

import numpy as np
import pytest

import ckpt
from ckpt.storage import RetryPolicy, Storage
from ckpt.storage._s3 import MIN_PART_BYTES, split_parts
from tests.conftest import make_s3_options
from tests.dist import free_port

MiB = 1 << 20


def _query(req) -> dict[str, list[str]]:
    return urllib.parse.parse_qs(urllib.parse.urlsplit(req.path).query, keep_blank_values=True)


def _is_part(req) -> bool:
    return req.method == "PUT" and "partNumber" in _query(req)


def _proxied(s3_root, proxy, **retry) -> Storage:
    url = s3_root.url
    policy = RetryPolicy(**{"attempts": 5, "base_seconds": 0.01, "max_seconds": 0.05, **retry})
    return Storage(url, proxy.storage_options, retry=policy)


def _uploads(s3_server, prefix: str) -> list:
    out = s3_server.client().list_multipart_uploads(Bucket=s3_server.bucket, Prefix=prefix)
    return out.get("Uploads", [])


def _payload(total: int, num_buffers: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 255, total, dtype=np.uint8)
    cuts = np.linspace(0, total, num_buffers + 1).astype(int)
    # Mixed dtypes: a float32 view of part of the bytes, as tensors arrive from dcp_io.
    out = []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        chunk = data[a:b]
        if i % 2 and chunk.nbytes % 4 == 0:
            chunk = chunk.view(np.float32)
        out.append(chunk)
    return out


def _joined(buffers) -> bytes:
    return b"".join(b.tobytes() for b in buffers)


def test_split_parts_are_zero_copy_slices():
    a, b, c = bytearray(7), bytearray(3), bytearray(12)
    views = [memoryview(x) for x in (a, b, c)]
    parts = split_parts(views, 5)
    assert [sum(s.nbytes for s in p) for p in parts] == [5, 5, 5, 5, 2]
    # Only a part that spans buffers has more than one slice; every slice shares memory.
    assert [len(p) for p in parts] == [1, 2, 1, 1, 1]
    a[0], c[11] = 1, 2
    assert parts[0][0][0] == 1 and parts[-1][-1][-1] == 2


def test_small_object_is_one_put(s3_root, s3_proxy):
    storage = _proxied(s3_root, s3_proxy)
    data = [np.arange(MiB, dtype=np.uint8), b"tail"]
    storage.write_buffers("small.bin", data, part_bytes=8 * MiB)
    puts = [r for r in s3_proxy.requests if r.method in ("PUT", "POST")]
    assert len(puts) == 1 and not _query(puts[0])
    assert storage.read_bytes("small.bin") == _joined([data[0]]) + b"tail"


def test_multipart_upload_is_parallel_and_exact(s3_root, s3_proxy, s3_server):
    storage = _proxied(s3_root, s3_proxy)
    buffers = _payload(23 * MiB + 12345, 7)
    s3_proxy.delay = lambda req: 0.15 if _is_part(req) else 0.0  # let parts overlap
    storage.write_buffers("big.bin", buffers, part_bytes=5 * MiB, max_concurrency=3)
    parts = [r for r in s3_proxy.requests if _is_part(r)]
    assert sorted(int(_query(r)["partNumber"][0]) for r in parts) == [1, 2, 3, 4, 5]
    sizes = {int(_query(r)["partNumber"][0]): r.body_bytes for r in parts}
    assert [sizes[i] for i in range(1, 5)] == [5 * MiB] * 4 and sizes[5] == 3 * MiB + 12345
    assert 2 <= s3_proxy.max_in_flight <= 3
    kinds = [(r.method, tuple(sorted(_query(r)))) for r in s3_proxy.requests if not _is_part(r)]
    assert kinds == [("POST", ("uploads",)), ("POST", ("uploadId",))]
    assert storage.read_bytes("big.bin") == _joined(buffers)
    assert _uploads(s3_server, s3_root.prefix) == []


def test_part_size_is_raised_to_the_s3_minimum(s3_root, s3_proxy):
    storage = _proxied(s3_root, s3_proxy)
    buffers = _payload(11 * MiB, 3)
    storage.write_buffers("min.bin", buffers, part_bytes=1 * MiB)
    sizes = sorted((r.body_bytes for r in s3_proxy.requests if _is_part(r)), reverse=True)
    assert sizes == [MIN_PART_BYTES, MIN_PART_BYTES, 1 * MiB]
    assert storage.read_bytes("min.bin") == _joined(buffers)


def test_transient_errors_are_retried_and_counted(s3_root, s3_proxy, s3_server):
    storage = _proxied(s3_root, s3_proxy, attempts=6)
    buffers = _payload(16 * MiB, 4, seed=1)
    tries: dict[str, int] = {}
    plan = {"1": ["503"], "2": ["reset"], "3": ["503", "503"], "4": []}  # per part, by try

    def fault(req):
        if _is_part(req):
            number = _query(req)["partNumber"][0]
            tries[number] = tries.get(number, 0) + 1
            faults = plan[number]
            return faults[tries[number] - 1] if tries[number] <= len(faults) else None
        if req.method == "POST" and "uploads" in _query(req) and req.index == 0:
            return "503"  # the create, too
        return None

    s3_proxy.fault = fault
    storage.write_buffers("retried.bin", buffers, part_bytes=5 * MiB, max_concurrency=2)
    throttled = sum(r.injected == "503" for r in s3_proxy.requests)
    assert throttled == 4 and s3_proxy.num_injected == 5
    # Every 503 is retried by our policy; a reset of a reused keep-alive connection may
    # instead be retried once, silently, by aiohttp itself.
    assert throttled <= storage.retry.num_retries <= s3_proxy.num_injected
    s3_proxy.fault = lambda req: None
    assert storage.read_bytes("retried.bin") == _joined(buffers)
    assert _uploads(s3_server, s3_root.prefix) == []

    # Reads, listings and small writes are retried the same way.
    for action in (lambda: storage.read_bytes("retried.bin", 0, 10),
                   lambda: storage.listdir(""), lambda: storage.write_bytes("s.bin", b"s"),
                   lambda: storage.exists("s.bin")):
        before, first = storage.retry.num_retries, len(s3_proxy.requests)
        s3_proxy.fault = lambda req: "503" if req.index in (first, first + 1) else None
        action()
        assert storage.retry.num_retries - before == 2
    s3_proxy.fault = lambda req: None
    assert storage.read_bytes("s.bin") == b"s"


def test_failed_multipart_upload_is_aborted(s3_root, s3_proxy, s3_server):
    storage = _proxied(s3_root, s3_proxy, attempts=3)
    buffers = _payload(16 * MiB, 2, seed=2)
    s3_proxy.fault = lambda req: "503" if _is_part(req) and _query(req)["partNumber"] == ["2"] \
        else None
    with pytest.raises(ckpt.StorageUnavailableError, match="big.bin") as info:
        storage.write_buffers("big.bin", buffers, part_bytes=5 * MiB, max_concurrency=4)
    assert "SlowDown" in str(info.value) or "reduce your request rate" in str(info.value)
    aborts = [r for r in s3_proxy.requests if r.method == "DELETE" and "uploadId" in _query(r)]
    assert len(aborts) == 1
    assert _uploads(s3_server, s3_root.prefix) == []
    s3_proxy.fault = lambda req: None
    assert not storage.exists("big.bin")


def test_create_exclusive_uses_if_none_match(s3_root, s3_proxy):
    storage = _proxied(s3_root, s3_proxy)
    storage.create_exclusive("manifest.json", b"first")
    other = _proxied(s3_root, s3_proxy)  # another writer, say on another host
    with pytest.raises(FileExistsError):
        other.create_exclusive("manifest.json", b"second")
    puts = [r for r in s3_proxy.requests if r.method == "PUT"]
    assert len(puts) == 2
    assert all(r.headers.get("If-None-Match") == "*" for r in puts)
    assert storage.read_bytes("manifest.json") == b"first"


def test_create_exclusive_whose_answer_was_lost_counts_as_ours(s3_root, s3_proxy):
    """The PUT committed but its answer never came; the retry's 412 must not fail the save."""
    storage = _proxied(s3_root, s3_proxy)
    s3_proxy.fault = lambda req: "lost" if req.method == "PUT" and req.index == 0 else None
    storage.create_exclusive("manifest.json", b"mine")
    assert len([r for r in s3_proxy.requests if r.method == "PUT"]) == 2  # sent again
    assert storage.read_bytes("manifest.json") == b"mine"
    with pytest.raises(FileExistsError):
        storage.create_exclusive("manifest.json", b"another writer's")


def test_replace_if_unchanged_uses_if_match(s3_root, s3_proxy, s3_server):
    storage = _proxied(s3_root, s3_proxy)
    storage.write_bytes("lease.json", b"v1")
    etag = s3_server.client().head_object(Bucket=s3_server.bucket,
                                          Key=f"{s3_root.prefix}/lease.json")["ETag"]
    s3_proxy.requests.clear()
    assert storage.replace_if_unchanged("lease.json", b"v2", b"v1")
    put = [r for r in s3_proxy.requests if r.method == "PUT"]
    assert len(put) == 1 and put[0].headers.get("If-Match") == etag

    # Someone else writes between our read and our conditional PUT: the server refuses it.
    def intrude(req):
        if req.method == "PUT":
            s3_server.client().put_object(Bucket=s3_server.bucket,
                                          Key=f"{s3_root.prefix}/lease.json", Body=b"thief")
        return None

    s3_proxy.fault = intrude
    assert storage.replace_if_unchanged("lease.json", b"v3", b"v2") is False
    s3_proxy.fault = lambda req: None
    assert storage.read_bytes("lease.json") == b"thief"


def test_replace_whose_answer_was_lost_counts_as_ours(s3_root, s3_proxy):
    storage = _proxied(s3_root, s3_proxy)
    storage.write_bytes("lease.json", b"v1")
    first = len(s3_proxy.requests)
    s3_proxy.fault = lambda req: "lost" if req.method == "PUT" and req.index == first + 1 \
        else None
    assert storage.replace_if_unchanged("lease.json", b"v2", b"v1") is True
    # The retry reads the object again and finds our own data: no second PUT.
    assert [(r.method, r.injected) for r in s3_proxy.requests[first:]] == [
        ("GET", None), ("PUT", "lost"), ("GET", None)]
    assert storage.retry.num_retries == 1
    assert storage.read_bytes("lease.json") == b"v2"


@pytest.fixture(scope="module")
def moto_subprocess():
    """A moto server in its own process, so this process's allocations are only the client's."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k",
                              aws_secret_access_key="s", region_name="us-east-1")
        deadline = time.monotonic() + 30
        while True:
            try:
                client.create_bucket(Bucket="mem-bucket")
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_multipart_memory_stays_bounded(moto_subprocess):
    """32 MiB in 5 MiB parts, 2 at a time: the side allocations stay under 2 parts' worth
    (joining the buffers first, as s3fs's pipe_file needs, would allocate all 32 MiB)."""
    storage = Storage("s3://mem-bucket/bounded", make_s3_options(moto_subprocess))
    buffers = _payload(32 * MiB, 3, seed=3)
    storage.write_bytes("warm-up.bin", b"x")  # client set-up allocations are not the upload's
    tracemalloc.start()
    try:
        storage.write_buffers("big.bin", buffers, part_bytes=5 * MiB, max_concurrency=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"peak traced allocation during the upload: {peak / MiB:.2f} MiB")
    assert peak < 2 * 5 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert storage.size("big.bin") == 32 * MiB
    assert storage.read_bytes("big.bin", 20 * MiB, 20 * MiB + 100) == \
        _joined(buffers)[20 * MiB: 20 * MiB + 100]


def test_env_credentials_and_endpoint(s3_server, monkeypatch):
    """With AWS_ENDPOINT_URL and credentials in the environment, no storage_options needed."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    root = s3_server.new_root("env")
    storage = Storage(root.url)
    storage.write_bytes("x.bin", b"via env")
    assert Storage(*root).read_bytes("x.bin") == b"via env"
    assert os.environ["AWS_ACCESS_KEY_ID"]


# -- the write path: one PUT below two parts, multipart from two, the client's options -----
def test_object_under_two_parts_is_one_put(s3_root, s3_proxy):
    """Above one part but under two: one PUT (a multipart upload would add a create, a
    complete and a server-side assembly for at most two parts in flight)."""
    storage = _proxied(s3_root, s3_proxy)
    buffers = _payload(2 * MIN_PART_BYTES - 1, 5, seed=4)
    storage.write_buffers("one.bin", buffers, part_bytes=MIN_PART_BYTES)
    writes = [r for r in s3_proxy.requests if r.method in ("PUT", "POST")]
    assert len(writes) == 1 and not _query(writes[0])
    assert writes[0].body_bytes == 2 * MIN_PART_BYTES - 1
    assert storage.read_bytes("one.bin") == _joined(buffers)


def test_object_of_two_parts_is_multipart_and_exact(s3_root, s3_proxy, s3_server):
    storage = _proxied(s3_root, s3_proxy)
    buffers = _payload(2 * MIN_PART_BYTES + 7, 3, seed=5)
    storage.write_buffers("two.bin", buffers, part_bytes=MIN_PART_BYTES)
    sizes = sorted((r.body_bytes for r in s3_proxy.requests if _is_part(r)), reverse=True)
    assert sizes == [MIN_PART_BYTES, MIN_PART_BYTES, 7]
    assert storage.read_bytes("two.bin") == _joined(buffers)
    assert _uploads(s3_server, s3_root.prefix) == []


@pytest.mark.parametrize("fault", ["lost", "reset", "503"])
def test_failed_complete_is_retried_and_the_object_appears_whole(s3_root, s3_proxy, s3_server,
                                                                 fault):
    """The completing request fails: applied but unanswered ("lost"; moto, like S3, answers
    a repeated complete with success), dropped unapplied ("reset") or refused ("503")."""
    storage = _proxied(s3_root, s3_proxy)
    buffers = _payload(11 * MiB, 4, seed=6)
    done: list[int] = []

    def inject(req):
        if req.method == "POST" and "uploadId" in _query(req) and not done:
            done.append(req.index)
            return fault
        return None

    s3_proxy.fault = inject
    storage.write_buffers("done.bin", buffers, part_bytes=5 * MiB)
    completes = [r for r in s3_proxy.requests if r.method == "POST" and "uploadId" in _query(r)]
    assert len(completes) == 2 and completes[0].injected == fault
    assert storage.retry.num_retries == 1
    s3_proxy.fault = lambda req: None
    assert storage.read_bytes("done.bin") == _joined(buffers)
    assert _uploads(s3_server, s3_root.prefix) == []


def test_part_failing_mid_upload_leaves_nothing_visible(s3_root, s3_proxy, s3_server):
    """A part refused for good while others are in flight: the error names the file, the
    upload is aborted after every part in flight has ended (none lands after the abort),
    and neither the object nor its parts remain."""
    storage = _proxied(s3_root, s3_proxy, attempts=2)
    buffers = _payload(30 * MiB, 6, seed=7)
    s3_proxy.delay = lambda req: 0.2 if _is_part(req) else 0.0
    s3_proxy.fault = lambda req: "503" if _is_part(req) and _query(req)["partNumber"] == ["3"] \
        else None
    with pytest.raises(ckpt.StorageUnavailableError, match="mid.bin"):
        storage.write_buffers("mid.bin", buffers, part_bytes=5 * MiB, max_concurrency=3)
    abort = [r.index for r in s3_proxy.requests if r.method == "DELETE"]
    assert len(abort) == 1
    assert all(r.index < abort[0] for r in s3_proxy.requests if _is_part(r))
    assert not [r for r in s3_proxy.requests if r.method == "POST" and "uploadId" in _query(r)]
    s3_proxy.fault = lambda req: None
    assert not storage.exists("mid.bin")
    assert _uploads(s3_server, s3_root.prefix) == []


def test_writes_from_several_threads_are_in_flight_together(s3_root, s3_proxy):
    """Each writer thread sends its own request (no queue behind one I/O thread)."""
    from concurrent.futures import ThreadPoolExecutor

    storage = _proxied(s3_root, s3_proxy)
    s3_proxy.delay = lambda req: 0.3 if req.method == "PUT" else 0.0
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: storage.write_bytes(f"w{i}.bin", bytes([i]) * 1000), range(6)))
    assert s3_proxy.max_in_flight == 6
    assert [storage.read_bytes(f"w{i}.bin") for i in range(6)] == \
        [bytes([i]) * 1000 for i in range(6)]


def test_additional_request_arguments_reach_every_write(s3_root, s3_proxy, s3_server):
    """s3fs's ``s3_additional_kwargs`` go with each request that takes them (the PUT and the
    multipart create), and not with those that do not (parts, complete)."""
    opts = {**s3_proxy.storage_options,
            "s3_additional_kwargs": {"Metadata": {"writer": "ckpt"}, "ContentType": "x/ckpt"}}
    storage = Storage(s3_root.url, opts)
    storage.write_bytes("small.bin", b"s")
    storage.write_buffers("big.bin", _payload(10 * MiB, 2, seed=8), part_bytes=5 * MiB)
    client = s3_server.client()
    for name in ("small.bin", "big.bin"):
        head = client.head_object(Bucket=s3_server.bucket, Key=f"{s3_root.prefix}/{name}")
        assert head["Metadata"] == {"writer": "ckpt"} and head["ContentType"] == "x/ckpt"
    for r in s3_proxy.requests:
        carries = "x-amz-meta-writer" in {k.lower() for k in r.headers}
        assert carries == (r.method == "PUT" and not _is_part(r)
                           or r.method == "POST" and "uploads" in _query(r)), r.path


@pytest.mark.parametrize("options, match", [
    ({"config_kwargs": {"max_pool_connections": 0}}, "max_pool_connections.*>= 1.*got 0"),
    ({"config_kwargs": {"max_pool_connections": "8"}}, "max_pool_connections.*got '8'"),
    ({"session": object()}, r"storage_options\['session'\] is not supported"),
])
def test_bad_client_options_are_named(s3_server, options, match):
    with pytest.raises(ValueError, match=match) as info:
        Storage("s3://some-bucket/run", {**s3_server.storage_options, **options})
    assert "s3://some-bucket/run" in str(info.value)


def test_pool_size_option_is_used(s3_root, s3_server):
    from ckpt.storage._s3 import DEFAULT_MAX_POOL_CONNECTIONS, write_client

    for config, want in (({}, DEFAULT_MAX_POOL_CONNECTIONS), ({"max_pool_connections": 3}, 3)):
        storage = Storage(s3_root.url, {**s3_server.storage_options, "config_kwargs": config})
        storage.write_bytes("p.bin", b"p")
        client = write_client(storage.fs)
        assert client.meta.config.max_pool_connections == want
        assert client.meta.config.retries["total_max_attempts"] == 1  # RetryPolicy retries


@pytest.mark.parametrize("calculation", [None, "when_required"])
def test_single_put_carries_our_crc32c(s3_root, s3_proxy, s3_server, calculation):
    """A one-PUT object is sent with the CRC32C of its buffers (the server checks the body
    against it) instead of botocore's CRC32; with checksums only "when_required" (for
    S3-compatible stores that refuse them), neither."""
    import base64

    import crc32c

    opts = dict(s3_proxy.storage_options)
    if calculation:
        opts["config_kwargs"] = {"request_checksum_calculation": calculation}
    storage = Storage(s3_root.url, opts)
    buffers = _payload(3 * MiB + 5, 4, seed=9)
    storage.write_buffers("c.bin", buffers)
    (put,) = [r for r in s3_proxy.requests if r.method == "PUT"]
    headers = {k.lower(): v for k, v in put.headers.items()}
    want = base64.b64encode(crc32c.crc32c(_joined(buffers)).to_bytes(4, "big")).decode()
    assert headers.get("x-amz-checksum-crc32c") == (None if calculation else want)
    assert "x-amz-checksum-crc32" not in headers
    assert storage.read_bytes("c.bin") == _joined(buffers)
