"""``run_ranks`` from tests/dist.py, with each rank's report flushed before the rank exits.

tests/dist.py's worker puts its result on a multiprocessing queue and then leaves with
``os._exit``; the queue's feeder thread may not have written the result yet, so a report
(typically a long traceback) can be lost and the parent then waits for the full timeout
("no result ... hung?"). Here the queue is flushed right after the put. Drop this module once
tests/dist.py flushes by itself.
"""

from __future__ import annotations

from typing import Any, Callable

import tests.dist as _dist

__all__ = ["run_ranks"]


class _FlushingQueue:
    def __init__(self, queue):
        self._queue = queue

    def put(self, item) -> None:
        self._queue.put(item)
        self._queue.close()
        self._queue.join_thread()


def _worker(fn, rank, world_size, port, args, queue, env):
    _dist._worker(fn, rank, world_size, port, args, _FlushingQueue(queue), env)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Same contract as :func:`tests.dist.run_ranks`."""
    original = _dist._worker
    _dist._worker = _worker
    try:
        return _dist.run_ranks(fn, world_size, *args, **kwargs)
    finally:
        _dist._worker = original
