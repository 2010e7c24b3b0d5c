"""S3 contenders on a loopback moto server: our save, DCP's fsspec writer, a raw upload.

The server is moto's ``ThreadedMotoServer``, started as in ``tests/conftest.py`` but hosted
in a child process: in the bench's own process it would share the GIL with the uploads it
measures. It is an in-memory server on the same 2 CPUs, not real S3: the numbers compare
clients against each other under the same server, they are not S3 throughput.

Contenders, each writing the same state to a fresh prefix (deleted, untimed, afterwards):

* ``ours``: ``ckpt.save`` to ``s3://bucket/<prefix>`` with ``--threads`` files per rank
  (each file above 32 MiB goes up as a parallel multipart upload); ``ours_t{k}``: the same
  with ``num_threads=k`` for each k of ``--s3-ours-threads``.
* ``dcp_fsspec_t{k}``: ``dcp.save`` with DCP's ``FsspecWriter(thread_count=k)``.
* ``raw_put``: one ``put_object`` per tensor (``--tensors`` objects) from a thread pool of
  ``--s3-raw-threads`` boto3 workers, bodies read zero-copy from the tensors.

Every sample also records the CPU seconds the bench process (the client) and the moto
process (the server) spent in it (``<name>.cpu_client``, ``<name>.cpu_server``): moto is
CPU-bound here, so a client's time is mostly the server's work plus its own, shared out
over the 2 cores, and the CPU split says which side a difference comes from.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed.checkpoint as dcp
from _common import Contender, byte_view, interleave, now, tensors_of

BUCKET = "ckpt-bench"
KEY, SECRET, REGION = "bench-access-key", "bench-secret-key", "us-east-1"

_SERVER = r"""
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()  # until the parent closes our stdin (or dies)
server.stop()
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's HTTP server in a child process, with one bucket."""

    def __init__(self) -> None:
        for k, v in (("AWS_ACCESS_KEY_ID", KEY), ("AWS_SECRET_ACCESS_KEY", SECRET),
                     ("AWS_DEFAULT_REGION", REGION), ("AWS_EC2_METADATA_DISABLED", "true")):
            os.environ.setdefault(k, v)
        port = _free_port()
        self.endpoint_url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.close()
            raise RuntimeError(f"moto server did not start (said {line!r})")
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("moto server is not listening")
                time.sleep(0.1)
        self.client().create_bucket(Bucket=BUCKET)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": KEY, "secret": SECRET,
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION}}

    def client(self, max_pool_connections: int = 10):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=KEY,
                            aws_secret_access_key=SECRET, region_name=REGION,
                            config=Config(max_pool_connections=max_pool_connections))

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used so far (Linux)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def delete_prefix(self, prefix: str) -> None:
        s3 = self.client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                 Prefix=prefix + "/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
        for up in s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []):
            s3.abort_multipart_upload(Bucket=BUCKET, Key=up["Key"], UploadId=up["UploadId"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                self.proc.terminate()
                self.proc.wait(timeout=10)


def run_s3(state: dict, repeats: int, opts, log, server: MotoServer | None = None
           ) -> dict[str, Any]:
    own = server is None
    server = server or MotoServer()
    warnings.filterwarnings("ignore", message=".*assuming the intent is")
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        from ckpt.dcp import api
        from ckpt.storage import Storage
        from ckpt.storage._s3 import SegmentsReader

        tensors = tensors_of(state)
        views = [byte_view(t) for t in tensors]
        raw_client = server.client(max_pool_connections=max(10, opts.s3_raw_threads))
        prefixes: list[str] = []

        def timed(fn):
            """``fn`` as a contender: wall seconds of the part it times (it returns them),
            plus the client's and the server's CPU seconds over the same call."""
            def run() -> dict[str, float]:
                c0, s0 = os.times(), server.cpu_seconds()
                wall = fn()
                c1, s1 = os.times(), server.cpu_seconds()
                return {"": wall, "cpu_client": c1.user - c0.user + c1.system - c0.system,
                        "cpu_server": s1 - s0}
            return run

        def fresh(kind: str) -> str:
            p = f"{kind}-{uuid.uuid4().hex[:10]}"
            prefixes.append(p)
            return p

        def cleanup() -> None:
            while prefixes:
                server.delete_prefix(prefixes.pop())

        def ours(k: int):
            def run() -> float:
                storage = Storage(f"s3://{BUCKET}/{fresh('ours')}", server.storage_options)
                t0 = now()
                api.save(state, storage, 1, num_threads=k)
                return now() - t0
            return run

        def dcp_fsspec(k: int):
            def run() -> float:
                writer = FsspecWriter(f"s3://{BUCKET}/{fresh(f'dcp{k}')}", thread_count=k,
                                      sync_files=False, **server.storage_options)
                t0 = now()
                dcp.save(state, storage_writer=writer, no_dist=True)
                return now() - t0
            return run

        def raw_put() -> float:
            prefix = fresh("raw")

            def put(i: int) -> None:
                raw_client.put_object(Bucket=BUCKET, Key=f"{prefix}/obj{i:05d}",
                                      Body=SegmentsReader([views[i]]))

            t0 = now()
            with ThreadPoolExecutor(opts.s3_raw_threads) as pool:
                list(pool.map(put, range(len(views))))
            return now() - t0

        contenders = [
            Contender("ours", timed(ours(None)), after=cleanup),
            *[Contender(f"ours_t{k}", timed(ours(k)), after=cleanup)
              for k in opts.s3_ours_threads],
            *[Contender(f"dcp_fsspec_t{k}", timed(dcp_fsspec(k)), after=cleanup)
              for k in opts.s3_dcp_threads],
            Contender("raw_put", timed(raw_put), after=cleanup),
        ]
        series = interleave(contenders, repeats, log=log)
        return {"series": series,
                "info": {"endpoint": server.endpoint_url, "raw_objects": len(views),
                         "raw_threads": opts.s3_raw_threads,
                         "ours_threads": "library default (16 on S3)",
                         "cpus": len(os.sched_getaffinity(0)),
                         "errors": {c.name: c.error for c in contenders if c.error}}}
    finally:
        if own:
            server.close()
