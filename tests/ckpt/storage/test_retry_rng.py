"""Storage retries do not touch the job's random streams.

Backoff jitter draws from the retry policy's own generator: a save that hits transient
errors leaves torch's, Python's ``random`` and numpy's global generator states exactly as
they were (they are what ``RNGState`` saves, so a retry would otherwise change a resumed run).
"""

from __future__ import annotations

import random
import threading
import uuid

import fsspec
import numpy as np
import torch
from fsspec.implementations.memory import MemoryFileSystem

import ckpt
from ckpt.storage import RetryPolicy, Storage


class _FlakyMemoryFileSystem(MemoryFileSystem):
    """``memory://`` whose first ``num_failures`` file writes drop the connection."""

    protocol = "flakymem"
    num_failures = 0
    num_failed = 0
    _lock = threading.Lock()

    def _open(self, path, mode="rb", *args, **kwargs):
        if "w" in mode:
            with self._lock:
                fail = type(self).num_failed < type(self).num_failures
                if fail:
                    type(self).num_failed += 1
            if fail:
                raise ConnectionResetError(f"injected: connection reset writing {path}")
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation("flakymem", _FlakyMemoryFileSystem, clobber=True)


def _rng_states():
    return (torch.get_rng_state(), random.getstate(), np.random.get_state())


def _assert_same_states(before, after):
    assert torch.equal(before[0], after[0]), "torch's global RNG state changed"
    assert before[1] == after[1], "Python's random state changed"
    assert before[2][0] == after[2][0] and np.array_equal(before[2][1], after[2][1]) \
        and before[2][2:] == after[2][2:], "numpy's global RNG state changed"


def test_save_with_retries_leaves_global_rng_states_untouched():
    _FlakyMemoryFileSystem.num_failures, _FlakyMemoryFileSystem.num_failed = 3, 0
    policy = RetryPolicy(attempts=5, base_seconds=0.01, max_seconds=0.02)
    storage = Storage(f"flakymem://retry-rng-{uuid.uuid4().hex}", retry=policy)
    state = {"w": torch.arange(6, dtype=torch.float32), "meta": {"epoch": 1}}
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    before = _rng_states()
    ckpt.save(state, storage, 1, num_threads=2)
    assert policy.num_retries == 3 and _FlakyMemoryFileSystem.num_failed == 3
    _assert_same_states(before, _rng_states())
    loaded = {"w": torch.zeros(6), "meta": {"epoch": 0}}
    ckpt.load(loaded, storage, 1)
    assert torch.equal(loaded["w"], state["w"]) and loaded["meta"] == {"epoch": 1}


def test_call_and_acall_retries_leave_global_rng_states_untouched():
    import asyncio

    policy = RetryPolicy(attempts=4, base_seconds=0.001, max_seconds=0.002)
    failures = {"sync": 3, "async": 3}

    def flaky_sync():
        if failures["sync"]:
            failures["sync"] -= 1
            raise TimeoutError("injected")
        return "ok"

    async def flaky_async():
        if failures["async"]:
            failures["async"] -= 1
            raise ConnectionResetError("injected")
        return "ok"

    before = _rng_states()
    assert policy.call("write x", flaky_sync) == "ok"
    assert asyncio.run(policy.acall("write y", flaky_async)) == "ok"
    assert policy.num_retries == 6
    _assert_same_states(before, _rng_states())


def test_copies_of_a_policy_draw_their_own_jitter():
    import pickle

    policy = RetryPolicy(attempts=30, base_seconds=1.0, max_seconds=1.0)
    copies = [pickle.loads(pickle.dumps(policy)) for _ in range(2)]
    draws = [[c._jitter.random() for _ in range(4)] for c in copies]
    assert draws[0] != draws[1]  # ranks handed one pickled policy do not retry in lockstep


def test_one_backoff_for_storage_retries_and_save_attempts():
    from ckpt.storage import backoff_seconds

    assert [backoff_seconds(k, 0.5, 5.0) for k in range(1, 7)] == [0.5, 1, 2, 4, 5, 5]
    policy = RetryPolicy(attempts=30, base_seconds=0.2, max_seconds=10.0)
    for retry in range(1, 12):  # RetryPolicy's jitter stays below the same backoff
        cap = backoff_seconds(retry, 0.2, 10.0)
        delays = [policy._should_retry("x", TimeoutError(), retry) for _ in range(20)]
        assert all(0 <= d <= cap for d in delays) and max(delays) > cap / 4


def test_save_attempts_pause_the_documented_backoff_without_touching_global_rngs(
        tmp_path, monkeypatch):
    """The manager's save re-attempts pause ``retry_backoff_seconds`` doubling per attempt,
    at most 5 s, and draw from no random generator."""
    import time as real_time

    from ckpt.job import CheckpointManager, ManagerOptions, persist
    from tests.ckpt._mgr_util import FaultyStorage

    pauses = []

    class _Clock:
        monotonic = staticmethod(real_time.monotonic)

        @staticmethod
        def sleep(seconds):
            pauses.append(seconds)

    monkeypatch.setattr(persist, "time", _Clock)
    storage = FaultyStorage(str(tmp_path / "root"), fail_attempts=-1)
    before = _rng_states()
    with CheckpointManager(storage, ManagerOptions(max_attempts=6, retry_backoff_seconds=0.5),
                           retention=[]) as mgr:
        assert mgr.save(1, {"w": torch.ones(4)})
        assert mgr.wait(raise_errors=False) is None
    assert pauses == [0.5, 1, 2, 4, 5]
    _assert_same_states(before, _rng_states())
