"""The ``[fault_tolerance]`` section: training as torchft replica groups (off by default).

When enabled, ``parallel.dp_replicate`` is the number of replica groups. Each group is its
own torchrun job whose ranks hold one replica, laid out ``(pp, dp_shard, tp)`` as usual; the
groups meet at a lighthouse and average their gradients with torchft's fault-tolerant
all-reduce, so a group that dies leaves the others training (``trainer.ft``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import urllib.parse
from dataclasses import dataclass
from typing import ClassVar

from trainer.config._parallel import ParallelConfig
from trainer.config._section import Section, config_field as _f

__all__ = ["FaultToleranceConfig", "QUORUM_TIMEOUT_MARGIN_SECONDS"]

# Beyond a hung group's last moment of life: the hang watchdog polls every 5 s at most
# before it exits, then the lighthouse waits a heartbeat timeout; the rest is slack.
QUORUM_TIMEOUT_MARGIN_SECONDS = 15.0
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


@dataclass
class FaultToleranceConfig(Section):
    """Replica groups on torchft: who this group is, where the lighthouse is, the timeouts."""

    _section: ClassVar[str] = "fault_tolerance"
    enabled: bool = _f(False, "Train as one of parallel.dp_replicate torchft replica groups "
                              "(each its own torchrun job); see docs/trainer.md.")
    group_id: int = _f(-1, "This replica group's index, 0 .. parallel.dp_replicate - 1.")
    lighthouse: str = _f("http://localhost:29510", "URL of the torchft lighthouse "
                                                   "(python -m trainer lighthouse).")
    lighthouse_bind: str = _f(
        "127.0.0.1", "Address python -m trainer lighthouse listens on, at the lighthouse "
                     "URL's port: 127.0.0.1 = this host only; with groups on other hosts, "
                     "the address they reach it by (0.0.0.0 = every interface).")
    min_replicas: int = _f(1, "Replica groups a step needs to commit (the lighthouse's "
                              "--min_replicas).")
    heartbeat_timeout_seconds: float = _f(
        2.0, "Lighthouse: a group silent this long is dead; how long survivors stall.")
    join_timeout_seconds: float = _f(
        5.0, "Lighthouse: how long a changed quorum waits for heartbeating groups to join.")
    timeout_seconds: float = _f(
        30.0, "Cross-group all-reduce, commit vote and state transfer to a rejoining group.")
    quorum_timeout_seconds: float = _f(
        0.0, "Longest wait for a quorum; 0 = derived: hang timeout + metrics linger + "
             "heartbeat timeout + 15 s.")
    connect_timeout_seconds: float = _f(
        60.0, "How long to wait for the lighthouse at start before exiting with one line.")
    quorum_retries: int = _f(3, "Quorum requests retried after a failed one (a restarted "
                                "lighthouse).")
    max_failed_steps: int = _f(20, "Uncommitted steps in a row before the group exits (and "
                                   "torchrun restarts it).")
    lease_ttl_seconds: float = _f(
        15.0, "The checkpoint root's lease TTL: how long another group waits to take over "
              "writing when the writing group's host is lost.")
    lease_retry_steps: int = _f(10, "A group that does not write checkpoints tries to take "
                                    "the lease every this many steps.")
    alert_min_quorum: int = _f(0, "Quorum size below which ReplicaQuorumBelowMinimum fires; "
                                  "0 = parallel.dp_replicate (every group).")
    hostname: str = _f("", "Name other groups reach this group's rank 0 by; empty = "
                           "socket.gethostname().")

    def _validate(self) -> None:
        url = urllib.parse.urlsplit(self.lighthouse)
        if url.scheme not in ("http", "https") or not url.hostname:
            self._fail("lighthouse", f"{self.lighthouse!r} is not an http:// URL",
                       "e.g. http://lighthouse-host:29510")
        if not _is_host(self.lighthouse_bind):
            self._fail("lighthouse_bind", f"{self.lighthouse_bind!r} is not an IP address or "
                       "host name", "give the address alone (its port is the lighthouse "
                       "URL's), e.g. 127.0.0.1, 10.0.0.5, :: or 0.0.0.0")
        self._at_least("min_replicas", 1)
        for name in ("heartbeat_timeout_seconds", "join_timeout_seconds", "timeout_seconds",
                     "connect_timeout_seconds", "lease_ttl_seconds"):
            if not getattr(self, name) > 0:
                self._fail(name, f"must be > 0, got {getattr(self, name)}")
        self._at_least("quorum_timeout_seconds", 0, "use 0 to derive it")
        self._at_least("quorum_retries", 0)
        self._at_least("max_failed_steps", 1)
        self._at_least("lease_retry_steps", 1)
        self._at_least("alert_min_quorum", 0, "use 0 for every group")
        if self.enabled and self.group_id < 0:
            self._fail("group_id", "is unset", "give each replica group's launcher its own "
                       "--fault_tolerance.group_id=0, 1, ...")

    @property
    def lighthouse_port(self) -> int:
        """The port of :attr:`lighthouse` (its scheme's default when it names none)."""
        url = urllib.parse.urlsplit(self.lighthouse)
        return url.port or (443 if url.scheme == "https" else 80)

    @property
    def lighthouse_listen(self) -> str:
        """``host:port`` the lighthouse listens on: :attr:`lighthouse_bind` (an IPv6 address
        in brackets) at :attr:`lighthouse_port`."""
        host = self.lighthouse_bind
        return f"[{host}]:{self.lighthouse_port}" if ":" in host else \
            f"{host}:{self.lighthouse_port}"

    def group_layout(self, par: ParallelConfig) -> ParallelConfig:
        """One replica group's layout within the job's resolved ``par``: ``(pp, dp_shard,
        tp)``, the replicate axis left to torchft (``dp = dp_shard``, ``dp_replicate = 1``)."""
        return dataclasses.replace(par, dp=par.dp_shard, dp_replicate=1)


def _is_host(value: str) -> bool:
    """An IP address (v4 or v6, no brackets, no port) or a DNS host name."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return len(value) <= 253 and _HOST_NAME.fullmatch(value) is not None
