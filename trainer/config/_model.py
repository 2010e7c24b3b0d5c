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
                           has_output: bool = True, kv_dim: int | None = None) -> int:
    """Parameters of :class:`trainer.model.Transformer` with these sizes, or of one pipeline
    stage of it (``n_layers`` blocks, with or without the embedding and the output).

    A block is attention ``2 d^2 + 2 d kv`` (q and o are ``d x d``; k and v ``d x kv``, with
    ``kv = kv_dim``, the key/value heads times the head size: ``d`` unless grouped-query
    attention shares them; no biases), an MLP of ``3 d f`` when gated (SwiGLU: w1, w3, w2)
    or ``2 d f`` (GELU: w1, w2), and two RMSNorm weights ``2 d``. The first stage adds the
    token embedding ``V d``; the last the final norm ``d`` and the untied output projection
    ``V d``."""
    kv = dim if kv_dim is None else kv_dim
    block = 2 * dim * dim + 2 * dim * kv + (3 if gated_mlp else 2) * dim * ffn_dim + 2 * dim
    return (n_layers * block + vocab_size * dim * has_embedding
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

    def num_params(self) -> int:
        """Parameters of the whole model (:func:`num_transformer_params`)."""
        return num_transformer_params(self.dim, self.hidden_ffn_dim, self.vocab_size,
                                      n_layers=self.n_layers,
                                      gated_mlp=self.activation == "swiglu",
                                      kv_dim=self.kv_heads * self.head_dim)
