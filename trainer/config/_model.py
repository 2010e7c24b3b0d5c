"""The ``[model]`` section: the shape of the reference transformer, and the one count of
its parameters (:func:`num_transformer_params`), which the model, the config and the layout
planner's memory model all use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.config._section import Section, config_field as _f

__all__ = ["ModelConfig", "num_transformer_params"]


def num_transformer_params(dim: int, ffn_dim: int, vocab_size: int, *, n_layers: int,
                           gated_mlp: bool, has_embedding: bool = True,
                           has_output: bool = True, kv_dim: int | None = None,
                           n_moe_layers: int = 0, n_experts: int = 0,
                           moe_ffn_dim: int | None = None, n_shared_experts: int = 0,
                           active_experts: int | None = None) -> int:
    """Parameters of :class:`trainer.model.Transformer` with these sizes, or of one pipeline
    stage of it (``n_layers`` blocks, with or without the embedding and the output).

    ``n_moe_layers`` of the ``n_layers`` blocks are mixture-of-experts blocks: their MLP is
    replaced by a router ``E d`` (``E = n_experts``), ``E`` expert MLPs of hidden size
    ``moe_ffn_dim`` (default ``ffn_dim``) and, with ``n_shared_experts = s``, one shared MLP
    of hidden size ``s * moe_ffn_dim``. ``active_experts = experts_per_token`` counts the
    parameters one token uses (the active ones: that many routed experts per block).

    A block is attention ``2 d^2 + 2 d kv`` (q and o are ``d x d``; k and v ``d x kv``, with
    ``kv = kv_dim``, the key/value heads times the head size: ``d`` unless grouped-query
    attention shares them; no biases), an MLP of ``3 d f`` when gated (SwiGLU: w1, w3, w2)
    or ``2 d f`` (GELU: w1, w2), and two RMSNorm weights ``2 d``. The first stage adds the
    token embedding ``V d``; the last the final norm ``d`` and the untied output projection
    ``V d``."""
    kv = dim if kv_dim is None else kv_dim
    mats = 3 if gated_mlp else 2
    block = 2 * dim * dim + 2 * dim * kv + 2 * dim
    fm = ffn_dim if moe_ffn_dim is None else moe_ffn_dim
    routed = n_experts if active_experts is None else active_experts
    moe_mlp = n_experts * dim + (routed + n_shared_experts) * mats * dim * fm
    return (n_layers * block + (n_layers - n_moe_layers) * mats * dim * ffn_dim
            + n_moe_layers * moe_mlp + vocab_size * dim * has_embedding
            + (dim + vocab_size * dim) * has_output)


@dataclass
class ModelConfig(Section):
    """Shape of the reference decoder-only transformer, :class:`trainer.model.Transformer`
    (the defaults have ~0.16M parameters, configs/gpu_1b.toml's shape ~1.06B)."""

    _section: ClassVar[str] = "model"
    vocab_size: int = _f(256, "Number of token ids; every data token must be < vocab_size.")
    dim: int = _f(64, "Hidden size (d_model); a multiple of n_heads.")
    n_layers: int = _f(2, "Number of transformer blocks.")
    n_heads: int = _f(4, "Attention heads; head size dim / n_heads must be even (rotary).")
    n_kv_heads: int | None = _f(None, "Key/value heads (grouped-query attention), a divisor "
                                      "of n_heads; None = n_heads.")
    ffn_dim: int | None = _f(None, "Hidden size of the MLP; None = ffn_multiplier * dim.")
    ffn_multiplier: float = _f(4.0, "MLP size relative to dim, used when ffn_dim is None.")
    activation: str = _f("swiglu", "MLP kind: 'swiglu' (3 matrices) or 'gelu' (2 matrices).")
    max_seq_len: int = _f(2048, "Longest sequence the model accepts; >= training.seq_len.")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon.")
    rope_theta: float = _f(10000.0, "Rotary embedding base.")
    init_std: float = _f(0.02, "Std of the initial weights (seeded by training.seed).")
    n_experts: int = _f(0, "Mixture of experts: routed experts per MoE block; 0 = dense, else >= 2.")
    experts_per_token: int = _f(2, "MoE: experts each token is routed to (top-k), 1..n_experts.")
    moe_every: int = _f(1, "MoE: block i (0-based) is an MoE block iff (i + 1) % moe_every == 0.")
    n_shared_experts: int = _f(0, "MoE: shared experts every token goes through (no gate).")
    moe_ffn_dim: int | None = _f(None, "MoE: hidden size of one expert; None = the MLP's.")
    router_aux_loss_coef: float = _f(0.01, "MoE: load-balancing loss coefficient; 0 = none.")

    def _validate(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            self._at_least(name, 1)
        if self.ffn_dim is not None:
            self._at_least("ffn_dim", 1, "or leave it unset for ffn_multiplier * dim")
        if self.dim % self.n_heads:
            self._fail("dim", f"{self.dim} is not a multiple of model.n_heads={self.n_heads}",
                       "pick dim = n_heads * head_dim")
        if self.head_dim % 2:
            self._fail("n_heads", f"head size dim / n_heads = {self.head_dim} is odd; rotary "
                       "embeddings rotate pairs", "change model.dim or model.n_heads")
        if self.n_kv_heads is not None:
            self._at_least("n_kv_heads", 1, "or leave it unset for n_heads")
            if self.n_heads % self.n_kv_heads:
                self._fail("n_kv_heads", f"{self.n_kv_heads} does not divide model.n_heads="
                           f"{self.n_heads}", "each key/value head serves n_heads / n_kv_heads "
                           "query heads: pick a divisor, or leave it unset for n_heads")
        self._choice("activation", ("swiglu", "gelu"))
        for name in ("ffn_multiplier", "norm_eps", "rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                self._fail(name, f"must be > 0, got {getattr(self, name)}")
        self._validate_moe()

    def _validate_moe(self) -> None:
        if self.n_experts != 0 and self.n_experts < 2:
            self._fail("n_experts", f"must be 0 (dense) or >= 2, got {self.n_experts}",
                       "use 0 for a dense model")
        self._at_least("moe_every", 1, "use 1 for an MoE block everywhere")
        self._at_least("n_shared_experts", 0)
        if self.moe_ffn_dim is not None:
            self._at_least("moe_ffn_dim", 1, "or leave it unset for the MLP's hidden size")
        if not self.router_aux_loss_coef >= 0:
            self._fail("router_aux_loss_coef", f"must be >= 0, got {self.router_aux_loss_coef}",
                       "use 0 to train without the load-balancing loss")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            self._fail("experts_per_token", f"{self.experts_per_token} is not in 1..model."
                       f"n_experts={self.n_experts}", "route each token to between 1 and "
                       "n_experts experts")
        if self.n_experts and not self.moe_layer_ids:
            self._fail("moe_every", f"{self.moe_every} > model.n_layers={self.n_layers}: no "
                       "block would be an MoE block", "use a moe_every <= n_layers, or "
                       "model.n_experts=0 for a dense model")

    @property
    def hidden_ffn_dim(self) -> int:
        """The MLP hidden size actually used."""
        return self.ffn_dim if self.ffn_dim is not None else int(self.ffn_multiplier * self.dim)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """The key/value heads actually used (``n_kv_heads``, or ``n_heads`` when unset)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def expert_ffn_dim(self) -> int:
        """The hidden size of one expert actually used (``moe_ffn_dim``, or the MLP's)."""
        return self.moe_ffn_dim if self.moe_ffn_dim is not None else self.hidden_ffn_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Is block ``layer_id`` (global, 0-based) a mixture-of-experts block? Qwen-MoE's
        ``decoder_sparse_step`` rule: ``n_experts > 0`` and ``(layer_id + 1) % moe_every == 0``."""
        return self.n_experts > 0 and (layer_id + 1) % self.moe_every == 0

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Global indices of the MoE blocks (empty for a dense model)."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    def num_params(self, active: bool = False) -> int:
        """Parameters of the whole model (:func:`num_transformer_params`); ``active``: those
        one token uses (its ``experts_per_token`` routed experts instead of all of them)."""
        return num_transformer_params(self.dim, self.hidden_ffn_dim, self.vocab_size,
                                      n_layers=self.n_layers,
                                      gated_mlp=self.activation == "swiglu",
                                      n_moe_layers=len(self.moe_layer_ids),
                                      n_experts=self.n_experts, moe_ffn_dim=self.expert_ffn_dim,
                                      n_shared_experts=self.n_shared_experts,
                                      active_experts=self.experts_per_token if active else None,
                                      kv_dim=self.kv_heads * self.head_dim)
