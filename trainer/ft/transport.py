"""Sending a healthy replica's state to a rejoining one over HTTP, pickle-free.

:class:`StateTransport` is a ``torchft.checkpointing.CheckpointTransport``: every rank of
every replica group runs one (a small HTTP server on an ephemeral port). When the quorum
says a group is behind, torchft calls ``send_checkpoint`` on rank k of a healthy group and
``recv_checkpoint`` on rank k of the group behind, which fetches
``GET {metadata}/replica/state/{step}`` from it. The bytes are :mod:`trainer.ft.wire`'s
encoding: JSON and raw tensor bytes, never a pickle.

Life of the state on the sending side (the same contract as torchft's ``HTTPTransport``)::

    send_checkpoint(step, state)   quorum thread: encode (references, no copy), serve step
    GET /replica/state/<step>      server threads: stream it; a request for a step not
                                   (yet) served waits up to the timeout
    disallow_checkpoint()          should_commit, before the optimizer step: wait for the
                                   transfers in flight, then stop serving and drop the state

So the optimizer never changes a tensor while a peer reads it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from torchft.checkpointing import CheckpointTransport

from trainer.ft import wire

__all__ = ["StateTransport", "TransferError"]

log = logging.getLogger(__name__)
_PATH = "/replica/state/"


class TransferError(RuntimeError):
    """Fetching a peer's state failed (unreachable, timed out, or a malformed message)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def handle_error(self, request, client_address) -> None:
        # A receiver that gave up (timed out, died) closes its end: not worth a traceback.
        log.debug("replica state request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class StateTransport(CheckpointTransport):
    """Serves this rank's state to a peer that is behind, and fetches a peer's.

    ``hostname``: the name peers reach this process by (``socket.gethostname()`` when empty);
    ``timeout``: of a transfer, and of a request waiting for the state it asks for.
    """

    def __init__(self, timeout: timedelta, hostname: str = ""):
        self.timeout = timeout.total_seconds()
        self.hostname = hostname or socket.gethostname()
        self._cond = threading.Condition()
        self._encoded: wire.Encoded | None = None
        self._step: int | None = None  # the step served, None while not serving
        self._serving = 0  # transfers in flight
        self.num_sent = 0
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = self.timeout  # socket timeout: a stalled peer does not pin a thread

            def log_message(self, *args) -> None:  # quiet: the trainer logs transfers
                pass

            def do_GET(self) -> None:
                transport._handle(self)

        try:
            self._server: ThreadingHTTPServer = _Server6(("::", 0), Handler)
        except OSError:  # no IPv6 on this host
            self._server = _Server(("0.0.0.0", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="replica-state-server", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    # -- CheckpointTransport ---------------------------------------------------------------
    def metadata(self) -> str:
        return f"http://{self.hostname}:{self.port}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                        timeout: timedelta) -> None:
        encoded = wire.encode(step, state_dict)
        with self._cond:
            self._encoded, self._step = encoded, step
            self._cond.notify_all()
        log.info("serving the state of step %d (%.1f MB) to replica group(s) %s", step,
                 encoded.body_bytes / 1e6, dst_ranks)

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._step = None
            deadline = time.monotonic() + self.timeout
            while self._serving and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            if self._serving:
                log.warning("%d state transfer(s) still running after %.0fs; the optimizer "
                            "step goes ahead (the receiver's checksum check fails them)",
                            self._serving, self.timeout)
            self._encoded = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> Any:
        url = f"{metadata}{_PATH}{step}"
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as resp:
                got, tree = wire.decode(resp, expect_step=step)
        except wire.WireError as exc:
            raise TransferError(f"state of step {step} from {url}: {exc}") from None
        except (OSError, urllib.error.URLError) as exc:
            raise TransferError(f"could not fetch the state of step {step} from {url}: "
                                f"{exc}") from None
        log.info("received the state of step %d from replica group %s in %.2fs", got,
                 src_rank, time.monotonic() - t0)
        return tree

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self.timeout)

    # -- serving ---------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        if not h.path.startswith(_PATH) or not h.path[len(_PATH):].isdigit():
            h.send_error(404, f"expected {_PATH}<step>")
            return
        step = int(h.path[len(_PATH):])
        with self._cond:
            deadline = time.monotonic() + self.timeout
            while self._step != step and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            if self._step != step:
                served = self._step
                encoded = None
            else:
                encoded = self._encoded
                self._serving += 1
        if encoded is None:
            h.send_error(409, f"step {step} is not served here (serving {served})")
            return
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            h.end_headers()
            for chunk in encoded.chunks():
                h.wfile.write(chunk)
            self.num_sent += 1
        except OSError as exc:
            log.warning("sending the state of step %d failed: %s", step, exc)
        finally:
            with self._cond:
                self._serving -= 1
                self._cond.notify_all()
