"""The mixture-of-experts router's metrics: ``train_step`` events' ``router`` statistics
become per-rank gauges (the worst block's imbalance, the mean balancing loss) and per-block
ones; a dense model's steps leave them at 0."""

from __future__ import annotations

from ckpt.events import EventBus
from monitoring import Metrics


def _value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"rank": "0", **labels})


def test_router_statistics_become_gauges():
    bus = EventBus(rank=0)
    m = Metrics(bus, rank=0)
    bus.emit("train_step", 1, loss=2.0, grad_norm=1.0, router=None)  # a dense model
    assert _value(m, "train_router_imbalance") == 0.0
    assert _value(m, "train_router_aux_loss") == 0.0
    bus.emit("train_step", 2, loss=2.0, grad_norm=1.0,
             router={"1": {"imbalance": 1.25, "aux_loss": 1.5},
                     "3": {"imbalance": 2.0, "aux_loss": 2.5}})
    assert _value(m, "train_router_imbalance") == 2.0  # the worst block
    assert _value(m, "train_router_aux_loss") == 2.0  # the mean over blocks
    assert _value(m, "train_router_layer_imbalance", layer="1") == 1.25
    assert _value(m, "train_router_layer_aux_loss", layer="3") == 2.5
    bus.emit("train_step", 3, loss=2.0, grad_norm=1.0,
             router={"1": {"imbalance": 1.0, "aux_loss": 1.0},
                     "3": {"imbalance": 1.0, "aux_loss": 1.0}})
    assert _value(m, "train_router_imbalance") == 1.0
    assert _value(m, "train_router_layer_imbalance", layer="3") == 1.0
