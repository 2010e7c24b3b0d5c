"""ModelState and RNGState: checkpointing must not change what training computes."""

from __future__ import annotations

import random

import torch

from ckpt.stateful import ModelState, RNGState


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
