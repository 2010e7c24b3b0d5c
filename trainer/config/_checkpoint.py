"""The ``[checkpoint]`` section: where, when and how checkpoints are written (the durable
root and the optional node-local tier) and which one is loaded, or which Hugging Face folder
a run starts from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckpt import Storage
from ckpt.cadence import Interval
from trainer.config._section import Section, config_field as _f

__all__ = ["CheckpointConfig"]


@dataclass
class CheckpointConfig(Section):
    """Where, when and how checkpoints are written and which one is loaded."""

    _section: ClassVar[str] = "checkpoint"
    root: str = _f("", "Directory or URL (file://, s3://, memory://); empty = no checkpoints.")
    interval: str = _f("auto", "'auto' (Young/Daly), steps like '50', or time like '30sec', '5m'.")
    load_step: int | None = _f(None, "Step to resume from; None = newest committed checkpoint.")
    keep_last: int = _f(3, "Committed checkpoints to keep; 0 = keep all.")
    keep_every: int = _f(0, "Also keep every checkpoint whose step is a multiple; 0 = off.")
    async_save: bool = _f(True, "Persist in the background; training stalls only to stage.")
    verify: str = _f("full", "Check on load: 'full' (checksums), 'size', or 'none'.")
    mtbf_hours: float = _f(24.0, "Prior mean time between failures of the job, for 'auto'.")
    overhead_budget: float = _f(0.01, "Target fraction of time spent saving, for 'auto'.")
    storage_options: dict[str, Any] = _f({}, "Extra fsspec options, e.g. {endpoint_url = ...}.")
    resume: bool = _f(True, "Resume from root when it holds a checkpoint.")
    initial_load: str = _f("", "Hugging Face folder (path or URL; storage_options apply) to "
                               "start from when no checkpoint is resumed; committed as step 0.")
    allow_fresh_start_over_damaged: bool = _f(
        False, "Start from step 0 when every checkpoint under root is damaged (else refuse).")
    fail_on_error: bool = _f(False, "Stop the job when a save fails instead of alerting.")
    local_root: str = _f("", "Fast local tier on each node (NVMe, /dev/shm; '{node}' = node "
                             "index), saved more often than root; empty = off.")
    local_interval: str = _f("auto", "The local tier's interval, same forms as interval "
                                     "(used only with local_root).")
    local_keep_last: int = _f(2, "Local checkpoints kept on each node (>= 1).")
    local_copies: int = _f(1, "Copies of each node's local checkpoints: 1, or 2 = also on "
                                "the next node, so the local tier survives a lost node.")
    node_loss_mtbf_hours: float = _f(
        0.0, "With local_root: prior mean time between failures the local tier does not "
             "survive (node losses; with local_copies=2, of two neighbours), for root's "
             "'auto' (mtbf_hours is the local tier's); 0 = mtbf_hours.")

    def _validate(self) -> None:
        try:
            Interval.parse(self.interval)
        except ValueError as exc:
            self._fail("interval", str(exc))
        try:
            Interval.parse(self.local_interval)
        except ValueError as exc:
            self._fail("local_interval", str(exc))
        self._at_least("local_keep_last", 1, "a local tier keeps at least its newest step")
        if isinstance(self.local_copies, bool) or self.local_copies not in (1, 2):
            self._fail("local_copies", f"must be 1 or 2, got {self.local_copies!r}",
                       "1 keeps each node's local checkpoints on that node only, 2 also "
                       "copies them to the next node (more copies are not supported)")
        if self.local_copies > 1 and not self.local_root:
            self._fail("local_copies", f"is {self.local_copies} but local_root is empty",
                       "copies on the next node are of the local tier: set "
                       "checkpoint.local_root too, or leave local_copies at 1")
        if self.node_loss_mtbf_hours != 0 and self.node_loss_mtbf_hours < self.mtbf_hours:
            self._fail("node_loss_mtbf_hours",
                       f"{self.node_loss_mtbf_hours} is below mtbf_hours={self.mtbf_hours}, "
                       f"but node losses are a subset of all failures",
                       "set it >= mtbf_hours, or 0 to use mtbf_hours")
        if self.local_root:
            if not self.root:
                self._fail("local_root", "is set but root is empty",
                           "the local tier sits under a durable one: set checkpoint.root too")
            if _same_folder(self.local_root.replace("{node}", "0"), self.root):
                self._fail("local_root", f"{self.local_root!r} is checkpoint.root={self.root!r} "
                                         f"or overlaps it",
                           "give the local tier its own folder on fast node-local storage "
                           "(e.g. /dev/shm/ckpt)")
        if self.initial_load and not self.root:
            self._fail("initial_load", "is set but root is empty",
                       "the imported weights are committed as step 0 under root, so that a "
                       "restart resumes from there: set checkpoint.root too")
        if self.load_step is not None:
            self._at_least("load_step", 0, "leave it unset to load the newest checkpoint")
        self._at_least("keep_last", 0, "use 0 to keep all")
        self._at_least("keep_every", 0, "use 0 to disable")
        self._choice("verify", ("full", "size", "none"))
        if not self.mtbf_hours > 0:
            self._fail("mtbf_hours", f"must be > 0, got {self.mtbf_hours}")
        if not 0 < self.overhead_budget < 1:
            self._fail("overhead_budget", f"must be in (0, 1), got {self.overhead_budget}",
                       "e.g. 0.01 for 1%")

    @property
    def enabled(self) -> bool:
        return bool(self.root)


def _same_folder(a: str, b: str) -> bool:
    """Do two roots name the same place (or one inside the other)?"""
    a, b = Storage.location(a), Storage.location(b)
    return a.startswith(b) or b.startswith(a)
