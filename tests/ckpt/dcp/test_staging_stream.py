"""Side-stream staging: the API every caller relies on, checked on CPU.

On CUDA ``StagingBuffers.stage`` only enqueues the device-to-host copies, so whoever reads
the staged buffers on the host must call ``wait_ready()`` first. Here a stand-in for the
pending copies (a ``ready`` object whose ``wait()`` is what writes the data into the
buffers) shows that the manager's persist thread waits before it writes a byte: without the
wait the checkpoint would hold the zeros left in the buffers. CPU staging is unchanged
(synchronous copies, nothing pending). The real CUDA path runs where a GPU is present.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ckpt.dcp import StagingBuffers
from ckpt.dcp.staging import CopyReady
from ckpt.job import CheckpointManager, ManagerOptions

pytestmark = pytest.mark.timeout(60)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(16, 8, generator=g),
                      "half": torch.randn(5, generator=g).to(torch.bfloat16)},
            "step": 7}


class _PendingCopies:
    """Copies that have not landed yet: the staged buffers hold zeros until ``wait()``."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], seconds: float):
        self.pairs, self.seconds, self.num_waits = pairs, seconds, 0
        for buf, _ in pairs:
            buf.zero_()

    def wait(self) -> float:
        self.num_waits += 1
        for buf, src in self.pairs:
            buf.copy_(src)
        return self.seconds


class _LateStaging(StagingBuffers):
    """Stages like CUDA does: the data arrives only when someone waits for it."""

    def stage(self, state_dict):
        staged, nbytes = super().stage(state_dict)
        assert self.ready is None  # CPU tensors: nothing pending
        pairs = [(staged["model"][k], state_dict["model"][k].clone()) for k in ("w", "half")]
        self.ready = _PendingCopies(pairs, seconds=0.25)
        return staged, nbytes


def test_cpu_staging_is_synchronous_and_has_nothing_to_wait_for():
    staging = StagingBuffers(pin_memory=False)
    state = _state()
    staged, nbytes = staging.stage(state)
    assert staging.ready is None and staging.wait_ready() is None
    assert nbytes == 16 * 8 * 4 + 5 * 2
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    assert staged["model"]["w"] is not state["model"]["w"] and staged["step"] == 7
    assert not staged["model"]["w"].is_pinned()
    state["model"]["w"].add_(1)  # the copy is already complete: training may mutate now
    assert not torch.equal(staged["model"]["w"], state["model"]["w"])


def test_persist_waits_for_the_copies_before_writing(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False))
    mgr.staging = _LateStaging(pin_memory=False)
    state = _state()
    expected = {k: v.clone() for k, v in state["model"].items()}
    assert mgr.save(1, state, block=True)
    ready = mgr.staging.ready
    assert ready.num_waits >= 1
    committed = mgr.events.of_kind("save_committed")[-1].fields
    assert committed["copy_seconds"] == 0.25
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    mgr.load_latest(loaded)
    mgr.close()
    for k, v in expected.items():
        assert torch.equal(loaded["model"][k], v), k  # zeros here: persist did not wait
    assert loaded["step"] == 7


def test_the_late_staging_stand_in_would_catch_a_missing_wait(tmp_path):
    """Adversarial check of the test above: a persist that skips the wait saves zeros."""
    mgr = CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False))
    mgr.staging = _LateStaging(pin_memory=False)
    mgr.staging.wait_ready = lambda: None  # a persist that forgot to wait
    state = _state()
    assert mgr.save(1, state, block=True)
    loaded = {"model": {k: torch.ones_like(v) for k, v in state["model"].items()}, "step": 0}
    mgr.load_latest(loaded)
    mgr.close()
    assert not loaded["model"]["w"].any()


def test_the_training_thread_never_waits_for_the_copies(tmp_path):
    """save() returns while the copies are still pending; the persist thread waits."""
    release, waiters = threading.Event(), []

    class Gated(_PendingCopies):
        def wait(self) -> float:
            waiters.append(threading.current_thread().name)
            assert release.wait(30), "nobody released the copies"
            return super().wait()

    class GatedStaging(_LateStaging):
        def stage(self, state_dict):
            staged, nbytes = super().stage(state_dict)
            self.ready = Gated(self.ready.pairs, seconds=0.5)
            return staged, nbytes

    mgr = CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False))
    mgr.staging = GatedStaging(pin_memory=False)
    state = _state()
    assert mgr.save(1, state)  # returns: the main thread did not wait for the copies
    deadline = time.monotonic() + 20
    while not waiters and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waiters and waiters[0].startswith("ckpt-persist"), waiters
    assert mgr.in_flight() and not mgr.events.of_kind("save_committed")
    release.set()
    mgr.wait()
    assert mgr.events.of_kind("save_committed")[-1].fields["copy_seconds"] == 0.5
    mgr.close()


def test_cpu_saves_report_no_copy_time(tmp_path):
    with CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False)) as mgr:
        mgr.save(1, _state(), block=True)
        assert mgr.events.of_kind("save_committed")[-1].fields["copy_seconds"] is None


def test_stage_and_borrow_wait_for_the_previous_copies():
    staging = _LateStaging(pin_memory=False)
    state = _state()
    staging.stage(state)
    first = staging.ready
    staging.borrow([64])  # a load must not read into buffers a copy still writes to
    assert first.num_waits == 1
    staging.stage(state)
    assert first.num_waits == 2 and staging.ready is not first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_on_a_side_stream_land_before_the_next_kernel():
    device = torch.device("cuda")
    staging = StagingBuffers()
    params = {"w": torch.randn(1 << 20, device=device), "b": torch.randn(7, device=device)}
    before = {k: v.cpu() for k, v in params.items()}
    torch.cuda.synchronize()
    staged, _ = staging.stage(params)
    assert isinstance(staging.ready, CopyReady) and staging.pinned and staged["w"].is_pinned()
    for v in params.values():
        v.mul_(0)  # the training stream's next kernel: must run after the copies
    assert staging.wait_ready() > 0
    for k, v in before.items():
        assert torch.equal(staged[k], v), k
    staging.stage(params)
    staging.wait_ready()
    assert not staged["w"].any()
