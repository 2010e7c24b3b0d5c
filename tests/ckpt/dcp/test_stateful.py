"""ModelState and RNGState: checkpointing must not change what training computes."""

from __future__ import annotations

import random

import pytest
import torch

from ckpt.dcp import ModelState, RNGState


def _train(touch_state_first: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if touch_state_first:  # what a manager's prepare()/load_latest() does before step 1
        ModelState(model, optim).state_dict()
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model.weight.detach().clone()


def test_reading_state_before_the_first_step_changes_nothing():
    assert torch.equal(_train(False), _train(True))


def test_rng_state_round_trip():
    rng = RNGState(rank=3)
    sd = rng.state_dict()
    assert list(sd) == ["rank3"]
    a = (torch.rand(3), random.random())
    rng.load_state_dict(sd)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


class _FakeCuda:
    """CUDA as RNGState sees it, on a host without CUDA: available, its generator a fixed
    state, ``set_rng_state`` recorded. ``initialized`` is what ``torch.cuda.is_initialized``
    says (False: a process that has run no CUDA operation yet)."""

    def __init__(self, monkeypatch, fill: int):
        self.state = torch.full((16,), fill, dtype=torch.uint8)
        self.set_to: list[torch.Tensor] = []
        self.initialized = False
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda state, device="cuda": self.set_to.append(state.clone()))


def _draws() -> tuple:
    return torch.rand(3), random.random()


def test_the_cuda_stream_is_saved_before_any_cuda_operation(monkeypatch):
    fake = _FakeCuda(monkeypatch, fill=7)
    state = RNGState(rank=0).state_dict()["rank0"]
    assert torch.equal(state["cuda"], fake.state)


def test_a_resume_before_any_cuda_operation_restores_the_cuda_stream(monkeypatch, tmp_path):
    """Saved after CUDA ran, loaded strictly in a new process before it did: same keys."""
    import ckpt

    fake = _FakeCuda(monkeypatch, fill=7)
    fake.initialized = True
    ckpt.save({"rng": RNGState(rank=0)}, str(tmp_path), 1)
    expected = _draws()
    fake.state, fake.initialized = torch.full((16,), 9, dtype=torch.uint8), False
    ckpt.load({"rng": RNGState(rank=0)}, str(tmp_path), 1)
    assert [s.tolist() for s in fake.set_to] == [[7] * 16]
    got = _draws()
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_a_gpu_checkpoint_on_a_cpu_host_refuses_strict_and_loads_without_cuda(
        monkeypatch, tmp_path):
    import ckpt
    from ckpt.errors import StateMismatchError
    from ckpt.export._consolidate import consolidate

    fake = _FakeCuda(monkeypatch, fill=7)
    ckpt.save({"rng": RNGState(rank=0)}, str(tmp_path), 1)
    expected = _draws()
    monkeypatch.undo()  # a host without CUDA
    assert not torch.cuda.is_available()
    with pytest.raises(StateMismatchError) as err:
        ckpt.load({"rng": RNGState(rank=0)}, str(tmp_path), 1)
    assert err.value.unexpected == ["rng.rank0.cuda"] and not err.value.missing
    ckpt.load({"rng": RNGState(rank=0)}, str(tmp_path), 1, ignore_keys=("rng.",))
    got = _draws()
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    assert not fake.set_to
    # Inspection and export read the CUDA stream as it was saved.
    assert consolidate(str(tmp_path), 1)[0]["rng"]["rank0"]["cuda"].tolist() == [7] * 16
    # Handed a CUDA stream directly, it refuses rather than drop it.
    saved = {"rank0": {**RNGState(rank=0).state_dict()["rank0"], "cuda": fake.state}}
    with pytest.raises(ValueError, match="CUDA is not available"):
        RNGState(rank=0).load_state_dict(saved)


def test_a_cpu_checkpoint_on_a_gpu_host_refuses_strict_and_keeps_the_cuda_stream(
        monkeypatch, tmp_path):
    import ckpt
    from ckpt.errors import StateMismatchError

    ckpt.save({"rng": RNGState(rank=0)}, str(tmp_path), 1)
    expected = _draws()
    fake = _FakeCuda(monkeypatch, fill=9)
    with pytest.raises(StateMismatchError) as err:
        ckpt.load({"rng": RNGState(rank=0)}, str(tmp_path), 1)
    assert err.value.missing == ["rng.rank0.cuda"] and not err.value.unexpected
    ckpt.load({"rng": RNGState(rank=0)}, str(tmp_path), 1, strict=False)
    got = _draws()
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    # The CUDA stream is set to what it already was (nothing else is known of it).
    assert all(torch.equal(s, fake.state) for s in fake.set_to)
