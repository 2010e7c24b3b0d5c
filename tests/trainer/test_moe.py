"""The mixture-of-experts layer of the reference model (``model.n_experts > 0``), in one
process: its config rules, its parameter names and counts, its routing against a token by
token reference (Mixtral's top-k, dropless even when every token picks the same experts),
its load-balancing loss and the gradient that loss adds, and training. The layouts
(expert parallelism with FSDP2, TP, PP) are test_parallel_equivalence.py's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tests.trainer import _parallel_worker as w
from trainer.config import ConfigError, ModelConfig, config_fingerprint, load_config
from trainer.model import MoE, Transformer, cross_entropy_loss
from trainer.parallelize import build_parallel_model

CFG = w.MOE


def _model(cfg: ModelConfig = CFG, seed: int = w.SEED) -> Transformer:
    m = Transformer(cfg)
    m.init_weights(seed)
    return m


@pytest.mark.parametrize("overrides,key,words", [
    (dict(n_experts=1), "model.n_experts", "must be 0 (dense) or >= 2, got 1"),
    (dict(n_experts=4, experts_per_token=5), "model.experts_per_token",
     "5 is not in 1..model.n_experts=4"),
    (dict(n_experts=4, experts_per_token=0), "model.experts_per_token", "0 is not in 1..model.n_experts=4"),
    (dict(n_experts=4, moe_every=0), "model.moe_every", "must be >= 1"),
    (dict(n_experts=4, moe_every=3, n_layers=2), "model.moe_every",
     "3 > model.n_layers=2: no block would be an MoE block"),
    (dict(n_experts=4, n_shared_experts=-1), "model.n_shared_experts", "must be >= 0"),
    (dict(n_experts=4, moe_ffn_dim=0), "model.moe_ffn_dim", "must be >= 1"),
    (dict(n_experts=4, router_aux_loss_coef=-0.1), "model.router_aux_loss_coef",
     "must be >= 0, got -0.1"),
])
def test_config_errors_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**overrides)
    msg = str(e.value)
    assert msg.startswith(f"{key}: ") and words in msg and "\n" not in msg, msg


def test_fingerprint_of_a_dense_config_is_unchanged_and_moe_keys_count():
    dense = load_config(None, [])
    assert config_fingerprint(dense) == "0aa0915fc6a699d3"  # as before the MoE keys existed
    moe = load_config(None, ["--model.n_experts=4"])
    topk = load_config(None, ["--model.n_experts=4", "--model.experts_per_token=1"])
    assert len({config_fingerprint(c) for c in (dense, moe, topk)}) == 3


def test_names_shapes_and_counts():
    m = _model()
    params = dict(m.named_parameters())
    e, f, d = CFG.n_experts, CFG.expert_ffn_dim, CFG.dim
    assert CFG.moe_layer_ids == (1, 3)
    for i in CFG.moe_layer_ids:
        assert f"layers.{i}.feed_forward.w1.weight" not in params
        assert params[f"layers.{i}.moe.router.weight"].shape == (e, d)
        assert params[f"layers.{i}.moe.experts.w1"].shape == (e, f, d)
        assert params[f"layers.{i}.moe.experts.w3"].shape == (e, f, d)
        assert params[f"layers.{i}.moe.experts.w2"].shape == (e, d, f)
        assert params[f"layers.{i}.moe.shared.w2.weight"].shape == (d, f)
    assert "layers.0.feed_forward.w1.weight" in params and "layers.0.moe.router.weight" not in params
    assert CFG.num_params() == sum(p.numel() for p in m.parameters())
    # One token uses its 2 routed experts of 4: the other 2 per MoE block are inactive.
    assert CFG.num_params() - CFG.num_params(active=True) == 2 * 2 * 3 * d * f
    gelu = dataclasses.replace(CFG, activation="gelu", n_shared_experts=0)
    g = _model(gelu)
    assert g.layers["1"].moe.experts.w3 is None and g.layers["1"].moe.shared is None
    assert gelu.num_params() == sum(p.numel() for p in g.parameters())
    # Init: by name, the experts' w2 scaled as a residual output projection.
    w1, w2 = params["layers.1.moe.experts.w1"], params["layers.1.moe.experts.w2"]
    assert w2.std() < w1.std() / 2
    assert not torch.equal(params["layers.1.moe.experts.w1"], params["layers.3.moe.experts.w1"])


def _reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: Mixtral's routing, and the per-sequence balancing loss."""
    bsz, seq, _ = x.shape
    n, k = moe.num_experts, moe.top_k
    ex = moe.experts
    out = torch.zeros_like(x)
    probs = (x.float() @ moe.router.weight.float().t()).softmax(-1)
    frac = torch.zeros(bsz, n)
    for b in range(bsz):
        for s in range(seq):
            top = probs[b, s].topk(k)
            for weight, e in zip(top.values / top.values.sum(), top.indices.tolist()):
                t = x[b, s]
                h = F.silu(ex.w1[e] @ t) * (ex.w3[e] @ t)
                out[b, s] = out[b, s] + weight * (ex.w2[e] @ h)
                frac[b, e] += 1.0 / (seq * k)
    out = out + moe.shared(x)
    aux = n * (frac * probs.mean(1)).sum(-1).mean()
    return out, aux


@pytest.mark.parametrize("collapse", [False, True], ids=["spread", "collapsed"])
def test_routing_matches_token_by_token_reference_and_drops_nothing(collapse):
    moe = _model().layers["1"].moe
    x = torch.randn(2, 16, CFG.dim, generator=torch.Generator().manual_seed(3))
    if collapse:  # every token prefers experts 2 then 0: no capacity limit drops any
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[2] = 1.0
            moe.router.weight[0] = 0.5
        x = x.abs()
    got = moe(x)
    want, aux = _reference(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    stats = moe.take_stats()
    assert sum(stats.tokens_per_expert) == 2 * 16 * CFG.experts_per_token
    assert stats.aux_loss == pytest.approx(float(aux.detach()), rel=1e-6)
    if collapse:
        assert stats.tokens_per_expert == [32.0, 0.0, 32.0, 0.0]
        assert stats.imbalance == 2.0 and stats.aux_loss > 1.0
    assert moe.take_stats() is None  # taken


def test_balancing_loss_gradient_is_the_added_loss():
    """The gradient the MoE blocks add equals that of cross-entropy + coef * mean of the
    blocks' balancing losses, computed explicitly."""
    cfg = dataclasses.replace(CFG, router_aux_loss_coef=0.5)  # large: the norms must differ
    x, y = w.make_batches(1)[0]
    model = _model(cfg)
    cross_entropy_loss(model(x), y).backward()
    ref = _model(cfg)
    auxes = []
    for moe in ref.moe_blocks().values():
        moe.forward = lambda h, moe=moe: auxes.append(_reference(moe, h)[1]) or \
            _reference(moe, h)[0]
    (cross_entropy_loss(ref(x), y) + 0.5 * torch.stack(auxes).mean()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)
    no_aux = _model(dataclasses.replace(cfg, router_aux_loss_coef=0.0))
    cross_entropy_loss(no_aux(x), y).backward()
    router = "layers.1.moe.router.weight"
    assert not torch.allclose(dict(no_aux.named_parameters())[router].grad,
                              dict(model.named_parameters())[router].grad)


def test_one_process_trains_and_reports_router_stats():
    pm = build_parallel_model(CFG, w.layout(CFG), None, w.SEED)
    got = w.train(pm, 0, 1, steps=10)
    assert got["losses"][-1] < 0.7 * got["losses"][0]
    assert all(math.isfinite(v) for v in got["losses"] + got["norms"])
    stats = pm.take_router_stats()
    assert sorted(stats) == [1, 3]
    for s in stats.values():
        assert sum(s.tokens_per_expert) == 10 * w.GLOBAL_BATCH * w.SEQ_LEN * 2
        assert 1.0 <= s.imbalance <= 2.0 and s.aux_loss >= 1.0 - 1e-6


def test_activation_checkpointing_leaves_moe_training_bit_identical():
    """Recomputed MoE blocks (router, dispatch, experts, the balancing loss's gradient) give
    the losses and gradient norms of a run without recomputation, bit for bit, and the
    same router statistics (a recomputation torch does not stop early counts again, which
    leaves the imbalance and the mean loss as they are)."""
    plain = build_parallel_model(CFG, w.layout(CFG), None, w.SEED)
    ac = build_parallel_model(CFG, w.layout(CFG), None, w.SEED,
                              recomputed_layers=frozenset(range(CFG.n_layers)))
    assert w.train(ac, 0, 1, steps=4) == w.train(plain, 0, 1, steps=4)
    a, b = plain.take_router_stats(), ac.take_router_stats()
    for layer in CFG.moe_layer_ids:
        assert b[layer].tokens_per_expert in (a[layer].tokens_per_expert,
                                              [2 * t for t in a[layer].tokens_per_expert])
        assert b[layer].imbalance == pytest.approx(a[layer].imbalance, rel=1e-12)
        assert b[layer].aux_loss == pytest.approx(a[layer].aux_loss, rel=1e-12)
