"""The lighthouse: starting one (``python -m trainer lighthouse``), and watching it.

The lighthouse (torchft's, a small Rust server) holds the quorum: every replica group's rank
0 heartbeats to it, and at every step it tells the groups which of them train together. It
keeps no state a restart would lose except the quorum id, so run it under a supervisor on a
fixed address (docs/trainer.md, "Fault-tolerant replica groups"). It serves the quorum to
anyone who reaches its port, so it listens on ``fault_tolerance.lighthouse_bind`` only
(default loopback: this host's groups).

:func:`serve` runs one in this process with the timing and address of a
``[fault_tolerance]`` section.
:func:`check_reachable` is the start-up check of a group (one clear line when no lighthouse
answers). :class:`LighthouseWatch` polls its status page from a group's rank 0 for the
metrics: is it up, and how many groups heartbeat to it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

from trainer.config import FaultToleranceConfig

__all__ = ["serve", "check_reachable", "probe", "LighthouseWatch", "LighthouseUnreachable",
           "QUORUM_TICK_MS"]

log = logging.getLogger(__name__)
QUORUM_TICK_MS = 100
_HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")


class LighthouseUnreachable(RuntimeError):
    """No lighthouse answers at ``fault_tolerance.lighthouse`` (the message is one line
    naming the URL and the fix)."""


def probe(url: str, timeout: float) -> tuple[bool, int | None, str]:
    """``(up, groups heartbeating or None, why not up)`` from one ``GET {url}/status``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as resp:
            text = resp.read(1 << 20).decode("utf-8", errors="replace")
    except (OSError, urllib.error.URLError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, None, str(reason)
    m = _HEARTBEATING.search(text)
    return True, int(m.group(1)) if m else None, ""


def check_reachable(ft: FaultToleranceConfig) -> None:
    """Wait up to ``ft.connect_timeout_seconds`` for the lighthouse to answer; raise
    :class:`LighthouseUnreachable` (one line naming the URL and the fix) if it never does."""
    deadline = time.monotonic() + ft.connect_timeout_seconds
    while True:
        up, _, why = probe(ft.lighthouse, timeout=min(2.0, ft.connect_timeout_seconds))
        if up:
            return
        if time.monotonic() >= deadline:
            raise LighthouseUnreachable(
                f"fault_tolerance.lighthouse: no lighthouse answers at {ft.lighthouse} "
                f"({why}) after {ft.connect_timeout_seconds:g}s; start one with `python -m "
                f"trainer lighthouse --config ...` on that host, listening on an address this "
                f"host reaches (fault_tolerance.lighthouse_bind), or fix the address")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(ft: FaultToleranceConfig, *, ready: Callable[[str], None] | None = None) -> int:
    """Run a lighthouse until SIGTERM or SIGINT; returns 0.

    It listens on ``ft.lighthouse_listen`` (``ft.lighthouse_bind`` at ``ft.lighthouse``'s
    port) and nowhere else. Its timing comes from ``ft``: ``--min_replicas``,
    ``--heartbeat_timeout_ms``, ``--join_timeout_ms`` (and a quorum tick of 100 ms), so the
    groups and the lighthouse agree on how fast a dead group is noticed. ``ready(address)``
    is called once it listens.
    """
    os.environ.setdefault("RUST_LOG", "warn")  # else a line per quorum tick and request
    from torchft.coordination import LighthouseServer

    url_host = urllib.parse.urlsplit(ft.lighthouse).hostname or ""
    if _loopback(ft.lighthouse_bind) and not _loopback(url_host):
        log.warning("the lighthouse listens on %s, which only this host reaches, but "
                    "fault_tolerance.lighthouse is %s: set --fault_tolerance.lighthouse_bind "
                    "to the address the groups reach it by", ft.lighthouse_bind, ft.lighthouse)
    server = LighthouseServer(bind=ft.lighthouse_listen, min_replicas=ft.min_replicas,
                              join_timeout_ms=int(ft.join_timeout_seconds * 1000),
                              quorum_tick_ms=QUORUM_TICK_MS,
                              heartbeat_timeout_ms=int(ft.heartbeat_timeout_seconds * 1000))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("lighthouse listening on %s (min_replicas %d, heartbeat timeout %gs, join "
             "timeout %gs)", ft.lighthouse_listen, ft.min_replicas,
             ft.heartbeat_timeout_seconds, ft.join_timeout_seconds)
    if ready is not None:
        ready(server.address())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
    return 0


class LighthouseWatch:
    """Polls the lighthouse every ``interval`` seconds in a thread; calls
    ``on_change(up, groups_alive)`` at the first poll and whenever either changes."""

    def __init__(self, url: str, on_change: Callable[[bool, int | None], None],
                 interval: float = 2.0):
        self.url, self.on_change, self.interval = url, on_change, interval
        self._stop = threading.Event()
        self._last: tuple[bool, int | None] | None = None
        self._thread = threading.Thread(target=self._run, name="lighthouse-watch", daemon=True)

    def start(self) -> "LighthouseWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            up, alive, _ = probe(self.url, timeout=min(2.0, self.interval))
            if (up, alive) != self._last:
                self._last = (up, alive)
                try:
                    self.on_change(up, alive)
                except Exception:  # noqa: BLE001 - monitoring never breaks training
                    log.exception("lighthouse watch callback failed")
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()
