"""``python -m trainer`` with one rank's hardware at fault, chosen by environment variables.

Run it like the trainer with the same arguments, plus any of:

* ``E2E_THROTTLE_RANK=R`` and ``E2E_THROTTLE_BYTES_PER_SECOND=B``: on rank R, a slow link:
  every all-reduce, all-gather and reduce-scatter completes ``nbytes / B`` seconds after
  its data arrived (an asynchronous one's future completes that much later; the peers are
  not held inside it, as with a slow copy from the NIC on that rank's side);
* ``E2E_LEAK_RANK=R``, ``E2E_LEAK_BYTES_PER_SECOND=B``, ``E2E_LEAK_AFTER_SECONDS=S`` (and
  ``E2E_LEAK_MAX_BYTES``, default 2 GiB): on rank R, from S seconds after its metrics
  endpoint starts, a growing allocation: B bytes a second, written and kept, up to the
  maximum.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

_RANK = int(os.environ.get("RANK", "0"))


class _DelayedWork:
    """A collective's work whose future completes ``delay`` seconds after the real one."""

    def __init__(self, work, delay: float):
        self._fut = torch.futures.Future()

        def fire(done) -> None:
            def complete() -> None:
                try:
                    self._fut.set_result(done.value())
                except Exception as exc:  # noqa: BLE001 - the peer's failure, passed on
                    self._fut.set_exception(exc)
            threading.Timer(delay, complete).start()

        work.get_future().then(fire)

    def get_future(self):
        return self._fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()


def _throttled(collective, rate: float, size_of):
    def call(*args, **kwargs):
        work = collective(*args, **kwargs)
        delay = size_of(*args, **kwargs) / rate
        if kwargs.get("async_op"):
            return _DelayedWork(work, delay)
        time.sleep(delay)
        return work
    return call


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


if os.environ.get("E2E_THROTTLE_RANK") == str(_RANK):
    _RATE = float(os.environ["E2E_THROTTLE_BYTES_PER_SECOND"])
    dist.all_reduce = _throttled(dist.all_reduce, _RATE, lambda t, *a, **k: _nbytes(t))
    dist.all_gather_single = _throttled(dist.all_gather_single, _RATE,
                                        lambda out, *a, **k: _nbytes(out))
    dist.reduce_scatter_single = _throttled(
        dist.reduce_scatter_single, _RATE,
        lambda *a, **k: _nbytes(k["input"] if "input" in k else a[1]))

if os.environ.get("E2E_LEAK_RANK") == str(_RANK):
    _LEAK = float(os.environ["E2E_LEAK_BYTES_PER_SECOND"])
    _AFTER = float(os.environ.get("E2E_LEAK_AFTER_SECONDS", "0"))
    _MAX = int(os.environ.get("E2E_LEAK_MAX_BYTES", str(2 << 30)))
    _kept: list[bytearray] = []

    def _leak() -> None:
        time.sleep(_AFTER)
        chunk = max(1, int(_LEAK / 10))
        while sum(map(len, _kept)) + chunk <= _MAX:
            _kept.append(bytearray(b"\x01") * chunk)  # written: resident
            time.sleep(0.1)

    from monitoring.metrics import Metrics

    _serve = Metrics.serve

    def _serve_then_leak(self, *args, **kwargs):
        out = _serve(self, *args, **kwargs)
        threading.Thread(target=_leak, name="e2e-leak", daemon=True).start()
        return out

    Metrics.serve = _serve_then_leak

if __name__ == "__main__":
    from trainer.__main__ import main

    sys.exit(main())
