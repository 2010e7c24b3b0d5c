"""A save's copy of the state: staged into a manager's reused host buffers, or borrowed.

Staging is the one stall of a save. A manager remembers the newest copy it staged
(:class:`StagedCopy`) so another manager can persist the same copy at the same step
(``CheckpointManager.save(..., reuse=...)``; ``ckpt.job.tiers`` saves both tiers with one stall).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ckpt.dcp import StagingBuffers, api

__all__ = ["StagedCopy", "stage_copy"]


@dataclass(frozen=True)
class StagedCopy:
    """A copy of the state staged by a manager at ``step`` (in its staging buffers), which
    another manager may persist too (``save(..., reuse=...)``): one stall for two saves."""

    step: int
    staged: Any
    nbytes: int
    stall_seconds: float
    wait_ready: Callable[[], float | None] = lambda: None


def stage_copy(staging: StagingBuffers, state: dict[str, Any], step: int,
               reuse: StagedCopy | None) -> StagedCopy:
    """The copy to persist for ``step``: ``reuse`` (checked to hold ``step``; no stall), or
    ``state`` staged into ``staging`` now (its stall measured)."""
    if reuse is not None:
        if reuse.step != step:
            raise ValueError(f"reuse holds step {reuse.step}, not step {step}: pass the "
                             f"copy staged at this step")
        # No stall here; the cadence still learns what a save of this state costs.
        return reuse
    t0 = time.monotonic()
    staged, nbytes = staging.stage(api.resolve_state(state))
    return StagedCopy(step, staged, nbytes, time.monotonic() - t0, staging.wait_ready)
