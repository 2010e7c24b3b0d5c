"""Step times seen by the checkpoint manager: the cost of a background save to training.

A save's stall is measured directly; what the background persist costs training is not: it
shows as longer steps while the save runs. ``StepTimes`` keeps two moving averages, of steps
taken while a save persisted and of steps taken without, and turns their difference into the
slowdown the ``auto`` cadence counts as part of a checkpoint's cost.
"""

from __future__ import annotations

__all__ = ["StepTimes"]


class StepTimes:
    """Exponential moving averages of step time, idle vs while a save persists."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.idle: float | None = None
        self.busy: float | None = None
        self.steps_while_busy = 0
        self._last: float | None = None

    def observe(self, now: float, busy: bool) -> float | None:
        """Call once per step with a monotonic ``now``; returns the step's duration (None
        for the first call)."""
        dt = None if self._last is None else now - self._last
        self._last = now
        if dt is None:
            return None
        if busy:
            self.busy = dt if self.busy is None else self.busy + self.weight * (dt - self.busy)
            self.steps_while_busy += 1
        else:
            self.idle = dt if self.idle is None else self.idle + self.weight * (dt - self.idle)
        return dt

    def save_started(self) -> None:
        """A new save begins: count its busy steps from zero."""
        self.steps_while_busy = 0

    def slowdown(self) -> float:
        """Extra training seconds spent while the last save persisted."""
        if self.idle is None or self.busy is None:
            return 0.0
        return max(0.0, self.busy - self.idle) * self.steps_while_busy
