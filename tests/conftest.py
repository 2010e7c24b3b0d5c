"""Shared fixtures: an S3 server on loopback, a fault-injecting S3 proxy, one root per backend.

``s3_server`` (session): moto's real HTTP server (``ThreadedMotoServer``) on 127.0.0.1 with a
bucket; requests travel over real HTTP, nothing is mocked in-process.
``s3_root``: a fresh ``s3://bucket/<prefix>`` per test.
``any_root``: parametrised over local path, ``file://`` URL, ``memory://`` and S3.
``s3_proxy``: a loopback HTTP proxy in front of the moto server that records requests and
can answer chosen ones with ``503 SlowDown`` or a connection reset.

Roots are :class:`StorageRoot` values: 2-tuples ``(url, storage_options)`` that unpack as
such and also carry ``.url``, ``.storage_options``, ``.kind`` and, for S3, ``.endpoint_url``,
``.bucket`` and ``.prefix``. ``storage_options`` is a plain dict with the endpoint and keys
spelled out, so it pickles into spawned rank processes (a ``memory://`` root does not cross
processes: its contents live in one process).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import logging
import os
import socket
import struct
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.dist import free_port

S3_BUCKET = "ckpt-test-bucket"
S3_REGION = "us-east-1"
S3_KEY = "testing-access-key"  # moto accepts any key unless auth is enforced (see enforce_auth)
S3_SECRET = "testing-secret-key"


def make_s3_options(endpoint_url: str, key: str = S3_KEY, secret: str = S3_SECRET) -> dict:
    """fsspec/s3fs storage_options for a moto endpoint; picklable, explicit (no env needed)."""
    return {"key": key, "secret": secret,
            "client_kwargs": {"endpoint_url": endpoint_url, "region_name": S3_REGION}}


class StorageRoot(tuple):
    """``(url, storage_options)`` plus attributes describing where it lives."""

    def __new__(cls, url: str, storage_options: dict | None, kind: str, **extra: Any):
        obj = super().__new__(cls, (url, storage_options))
        obj.kind = kind
        obj.endpoint_url = extra.pop("endpoint_url", None)
        obj.bucket = extra.pop("bucket", None)
        obj.prefix = extra.pop("prefix", None)
        assert not extra, extra
        return obj

    def __reduce__(self):
        return (_make_root, (self[0], self[1], self.kind, self.endpoint_url, self.bucket,
                             self.prefix))

    @property
    def url(self) -> str:
        return self[0]

    @property
    def storage_options(self) -> dict | None:
        return self[1]

    def __repr__(self) -> str:
        return f"StorageRoot({self.kind}: {self.url})"


def _make_root(url, options, kind, endpoint_url, bucket, prefix):
    return StorageRoot(url, options, kind, endpoint_url=endpoint_url, bucket=bucket,
                       prefix=prefix)


@dataclass
class S3Server:
    """A running moto server with one bucket."""

    endpoint_url: str
    bucket: str = S3_BUCKET
    key: str = S3_KEY
    secret: str = S3_SECRET
    region: str = S3_REGION
    _server: Any = field(default=None, repr=False)
    _clients: dict = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}"

    @property
    def storage_options(self) -> dict:
        return make_s3_options(self.endpoint_url, self.key, self.secret)

    def new_root(self, name: str = "t") -> StorageRoot:
        prefix = f"{name}-{uuid.uuid4().hex[:10]}"
        return StorageRoot(f"s3://{self.bucket}/{prefix}", self.storage_options, "s3",
                           endpoint_url=self.endpoint_url, bucket=self.bucket, prefix=prefix)

    def client(self, service: str = "s3", endpoint_url: str | None = None):
        """A boto3 client talking straight to the server (cached per service)."""
        key = (service, endpoint_url)
        if key not in self._clients:
            self._clients[key] = self._make_client(service, endpoint_url)
        return self._clients[key]

    def _make_client(self, service: str, endpoint_url: str | None):
        import boto3

        return boto3.client(service, endpoint_url=endpoint_url or self.endpoint_url,
                            aws_access_key_id=self.key, aws_secret_access_key=self.secret,
                            region_name=self.region)

    def delete_prefix(self, prefix: str) -> None:
        s3 = self.client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                 Prefix=prefix + "/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def _set_auth(self, value: str) -> None:
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset-auth",
                                     data=value.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req, timeout=10).read()

    @contextlib.contextmanager
    def enforce_auth(self):
        """Make the server check credentials (moto's IAM mode) inside the block.

        Yields ``(key, secret)`` of an IAM user allowed everything; every other key is
        refused with ``InvalidAccessKeyId``/403. Server-wide while active: use only in a test
        that does nothing else with S3 meanwhile.
        """
        iam = self.client("iam")
        user = f"u-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        k = iam.create_access_key(UserName=user)["AccessKey"]
        self._set_auth("0")
        try:
            yield k["AccessKeyId"], k["SecretAccessKey"]
        finally:
            self._set_auth("inf")


# -- parallel runs (scripts/test.sh: pytest-xdist, --dist loadfile) -------------------------
# A test file runs whole on one worker (its module fixtures and cached straight runs are
# made once). Files are handed out in collection order (--no-loadscope-reorder), so the
# slowest (the top of `pytest --durations` on 2 cores) come first: a long file started last
# would be the tail.
_SLOWEST_FIRST = ("tests/e2e/test_slurm.py", "tests/e2e/test_recipes.py",
                  "tests/e2e/test_resume.py",
                  "tests/e2e/test_torchrun_restarts.py",
                  "tests/monitoring/test_alerts_e2e.py", "tests/e2e/test_restarts.py",
                  "tests/e2e/test_trainer_cli_errors.py", "tests/e2e/test_tiers_multinode.py",
                  "tests/trainer/test_parallel_equivalence.py",
                  "tests/e2e/test_ft_replicas.py", "tests/e2e/test_multinode.py",
                  "tests/ckpt/format/test_parts.py", "tests/ckpt/cli/test_cli_errors.py",
                  "tests/e2e/test_trainer_cli.py", "tests/ckpt/root/test_crash.py",
                  "tests/e2e/test_damaged_resume.py", "tests/e2e/test_own_loop.py")


def pytest_configure(config):
    # The workers' temp folders share a parent, the run's own: uninterrupted reference runs
    # (tests/e2e/_jobs.py, straight_run) are made there once for every worker.
    if hasattr(config, "workerinput") and config.option.basetemp:
        os.environ["E2E_SHARED_TMP"] = str(Path(config.option.basetemp).parent)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable


@pytest.fixture(autouse=True)
def _process_determinism_restored():
    """A Trainer built in this process turns deterministic kernels on for the whole process
    (``training.deterministic``); each test leaves the flags as it found them."""
    import torch

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:4]
    if before[4] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[4]


@pytest.fixture(scope="session")
def s3_server():
    """moto's HTTP server on loopback with bucket ``S3_BUCKET``; fake credentials in the env."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    info = S3Server(endpoint_url=f"http://127.0.0.1:{port}", _server=server)
    with pytest.MonkeyPatch.context() as mp:
        # S3 applies a conditional PUT (If-Match, If-None-Match) atomically; moto checks the
        # condition and then writes, so two racing writers could both pass the check. Its
        # conditional PUTs are serialised here, so that the emulator keeps S3's guarantee
        # (the lease and the exclusive manifest create rely on it).
        from moto.s3.responses import S3Response

        conditional = threading.Lock()
        put_object = S3Response.put_object

        def atomic_put_object(self):
            if self.headers.get("If-Match") or self.headers.get("If-None-Match"):
                with conditional:
                    return put_object(self)
            return put_object(self)

        mp.setattr(S3Response, "put_object", atomic_put_object)
        # Only credentials: spawned ranks inherit them, and nothing can reach real AWS's
        # metadata service. The endpoint is passed explicitly in storage_options.
        mp.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
        mp.setenv("AWS_DEFAULT_REGION", S3_REGION)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        info.client().create_bucket(Bucket=info.bucket)
        try:
            yield info
        finally:
            server.stop()


@pytest.fixture
def s3_root(s3_server, request):
    """A fresh, empty ``s3://bucket/<prefix>`` root (a StorageRoot); removed afterwards."""
    root = s3_server.new_root(request.node.name[:40].replace("[", "-").replace("]", ""))
    yield root
    with contextlib.suppress(Exception):
        s3_server.delete_prefix(root.prefix)


@pytest.fixture
def s3_storage_options(s3_server) -> dict:
    return s3_server.storage_options


@pytest.fixture(params=["local", "file", "memory", "s3"])
def any_root(request, tmp_path):
    """An empty checkpoint root on each backend in turn, as ``(url, storage_options)``."""
    kind = request.param
    if kind == "local":
        yield StorageRoot(str(tmp_path / "root"), None, kind)
    elif kind == "file":
        yield StorageRoot((tmp_path / "root").as_uri(), None, kind)
    elif kind == "memory":
        import fsspec

        path = f"/ckpt-tests/{uuid.uuid4().hex[:12]}"
        yield StorageRoot(f"memory://{path}", None, kind)
        fs = fsspec.filesystem("memory")
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)
    else:
        yield request.getfixturevalue("s3_root")


# -- a fault-injecting proxy ------------------------------------------------------------------
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
               "trailer", "upgrade", "expect"}
_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message>'
             b'<RequestId>proxy</RequestId></Error>')


@dataclass
class ProxyRequest:
    index: int
    method: str
    path: str  # with the query string
    headers: dict[str, str]
    body_bytes: int
    injected: str | None = None


class FaultyS3Proxy:
    """HTTP proxy on loopback in front of an S3 endpoint.

    ``fault`` is called for each request as ``fault(request) -> None | "503" | "reset" |
    "lost"``: answer ``503 SlowDown``, reset the connection without forwarding, or forward
    the request and then reset the connection instead of answering (the request took effect
    but its answer is lost). ``delay(request) -> seconds`` holds a request before forwarding.
    ``requests`` records every request seen (headers included), ``num_injected`` the faults
    answered, ``max_in_flight`` the most requests handled at once.
    """

    def __init__(self, target_endpoint: str):
        target = target_endpoint.removeprefix("http://")
        host, port = target.split(":")
        self.target = (host, int(port))
        self.requests: list[ProxyRequest] = []
        self.fault: Callable[[ProxyRequest], str | None] = lambda req: None
        self.delay: Callable[[ProxyRequest], float] = lambda req: 0.0
        self.num_injected = 0
        self.max_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._httpd.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def storage_options(self) -> dict:
        return make_s3_options(self.endpoint_url)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _read_body(self, h) -> bytes:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += h.rfile.read(size)
                h.rfile.readline()
        length = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(length) if length else b""

    def _handle(self, h) -> None:
        body = self._read_body(h)
        with self._lock:
            req = ProxyRequest(len(self.requests), h.command, h.path, dict(h.headers.items()),
                               len(body))
            self.requests.append(req)
            action = self.fault(req)
            req.injected = action
            if action:
                self.num_injected += 1
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            pause = self.delay(req)
            if pause:
                time.sleep(pause)
            self._answer(h, body, action)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _answer(self, h, body: bytes, action: str | None) -> None:
        if action in ("reset", "lost"):
            if action == "lost":
                self._forward(h, body, answer=False)
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.close_connection = True
            return
        if action == "503":
            h.send_response(503, "Slow Down")
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(_SLOWDOWN)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(_SLOWDOWN)
            return
        self._forward(h, body)

    def _forward(self, h, body: bytes, answer: bool = True) -> None:
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP_BY_HOP}
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.target, timeout=60)
        try:
            conn.request(h.command, h.path, body=body if body or h.command in ("PUT", "POST")
                         else None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            if not answer:
                return
            h.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP_BY_HOP and k.lower() not in ("content-length", "server",
                                                                      "date"):
                    h.send_header(k, v)
            if h.command == "HEAD":
                h.send_header("Content-Length", resp.getheader("Content-Length", "0"))
            else:
                h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
        finally:
            conn.close()


@pytest.fixture
def s3_proxy(s3_server):
    """A :class:`FaultyS3Proxy` in front of ``s3_server`` (no faults until ``.fault`` is set)."""
    proxy = FaultyS3Proxy(s3_server.endpoint_url)
    yield proxy
    proxy.close()
