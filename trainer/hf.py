"""The reference model as a Hugging Face model: what every checkpoint carries so that
``ckpt export ROOT --format hf --out DIR`` writes a folder ``from_pretrained`` loads, and
the way back, a Hugging Face folder imported into the model (``checkpoint.initial_load``).

With ``model.activation = "swiglu"`` (the default) :class:`trainer.model.Transformer` is
Llama's architecture, the same math as transformers' ``LlamaForCausalLM``: pre-norm
blocks with RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``), rotary embeddings rotating the
halves ``(i, i + head_dim / 2)`` of each head with frequencies ``theta^(-2i / head_dim)``
(transformers' ``rotate_half`` layout, so ``wq``/``wk`` need no permutation), causal
attention scaled by ``1 / sqrt(head_dim)`` with ``model.n_kv_heads`` key/value heads
(grouped-query attention in transformers' ``repeat_kv`` order when fewer than the query
heads; ``num_key_value_heads``), a SwiGLU MLP ``w2(silu(w1 x) * w3 x)``, no biases and
an output projection not tied to the embedding. Only the weights' names differ (:func:`hf_names`). ``tests/trainer/test_hf.py``
loads the export with ``from_pretrained`` and compares logits with the model's.

A mixture of experts (``model.n_experts > 0``) with an MoE block everywhere
(``moe_every = 1``), no shared experts and SwiGLU experts is Mixtral's architecture,
transformers' ``MixtralForCausalLM``: the same attention, norms and embeddings, and in
each block ``block_sparse_moe``: a router ``gate`` (Mixtral's routing is the model's:
softmax in fp32, top-k, the k weights renormalised) and ``experts.{e}.w1/w2/w3`` per
expert, which the model stacks as ``moe.experts.w1/w2/w3`` ``[n_experts, ...]``: the export
splits them (``hf_export.json`` names a stacked weight by a list, one name per expert).
The per-expert layout is Mixtral's published one (``mistralai/Mixtral-8x7B-v0.1``); every
transformers version loads it (5.x fuses the experts into ``gate_up_proj`` /
``down_proj`` on load).

With ``activation = "gelu"`` no Hugging Face architecture matches (Llama's and Mixtral's
MLPs are gated, and the GELU models use LayerNorm, learned positions or biases), nor with
experts that Mixtral cannot hold (``moe_every > 1``: dense blocks between the MoE ones;
``n_shared_experts > 0``): :func:`hf_unavailable` says why in one line naming the
``[model]`` key and the fix, and that line is what ``ckpt export --format hf`` refuses the
checkpoint with (``--no-config`` exports the weights alone, under the model's own names).

Every save attaches (:func:`hf_attachments`) ``config.json``, a ``LlamaConfig`` (or
``MixtralConfig``), and ``hf_export.json``: the selection holding the weights
(``app.model.``, where :meth:`trainer.train.Trainer.checkpoint_state` puts them) and each
weight's Hugging Face name (``ckpt.export`` applies them; docs/store.md, "Export"), or,
without an architecture, only ``hf_export.json`` with the reason.

The other way (``checkpoint.initial_load``): :func:`import_hf` checks a folder's
``config.json`` against ``[model]`` field by field (:func:`check_hf_config`) and reads
its weights into the parallel model with :func:`ckpt.load_hf` under the inverse names,
each rank its own shards; the folder's tokenizer and generation files come back to be
attached to every save, and :func:`carried_attachments` keeps them across resumes.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

import torch

from ckpt import HFLoadReport, Manifest, Storage, load_hf
from ckpt.dcp import read_from
from ckpt.export import HF_CONFIG_NAME, HF_EXPORT_NAME
from ckpt.hf import HFFolder
from ckpt.ranks import Agreement, cpu_group
from trainer.config import ConfigError, ModelConfig
from trainer.model import Transformer

__all__ = ["HF_SELECT", "hf_unavailable", "hf_config", "hf_names", "hf_attachments",
           "check_hf_config", "import_hf", "carried_attachments"]

HF_SELECT = "app.model."  # the checkpoint keys of the model's weights (checkpoint_state)

# The model's parameter names -> LlamaForCausalLM's (MixtralForCausalLM's: the same, plus
# the MoE block's), applied in order (first match).
_MIXTRAL_ROUTER = (r"layers\.(\d+)\.moe\.router\.weight",
                   r"model.layers.\1.block_sparse_moe.gate.weight")
_MIXTRAL_EXPERTS = r"layers\.(\d+)\.moe\.experts\.(w[123])"  # one name per expert
_LLAMA_NAMES = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.w([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]


def hf_unavailable(cfg: ModelConfig) -> str | None:
    """Why the model has no Hugging Face architecture, one line naming the ``[model]`` key
    and the fix; None when it has one (Llama's, or Mixtral's for a mixture of experts)."""
    alone = "or export the weights alone with `ckpt export --format hf --no-config`"
    if cfg.activation != "swiglu":
        return (f"model.activation={cfg.activation!r}: no Hugging Face architecture has this "
                f"model's MLP (Llama's and Mixtral's are gated, the GELU models use LayerNorm, "
                f"learned positions or biases); train with model.activation='swiglu', {alone}")
    if cfg.n_experts and cfg.moe_every != 1:
        return (f"model.moe_every={cfg.moe_every}: Mixtral (MixtralForCausalLM) has an MoE "
                f"MLP in every block and this model dense ones between them; train with "
                f"model.moe_every=1, {alone}")
    if cfg.n_experts and cfg.n_shared_experts:
        return (f"model.n_shared_experts={cfg.n_shared_experts}: Mixtral (MixtralForCausalLM) "
                f"has no shared experts; train with model.n_shared_experts=0, {alone}")
    return None


def hf_config(cfg: ModelConfig) -> dict | None:
    """The ``config.json`` of a ``LlamaForCausalLM`` (a ``MixtralForCausalLM`` for a
    mixture of experts) with the model's sizes; None when the model has no Hugging Face
    architecture (:func:`hf_unavailable`)."""
    if hf_unavailable(cfg) is not None:
        return None
    if cfg.n_experts:
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                **_common_config(cfg, cfg.expert_ffn_dim),
                "num_local_experts": cfg.n_experts,
                "num_experts_per_tok": cfg.experts_per_token,
                "router_aux_loss_coef": cfg.router_aux_loss_coef,
                "output_router_logits": False,
                "router_jitter_noise": 0.0,
                "sliding_window": None,
                "attention_dropout": 0.0}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **_common_config(cfg, cfg.hidden_ffn_dim), "attention_bias": False,
            "mlp_bias": False}


def _common_config(cfg: ModelConfig, intermediate_size: int) -> dict:
    """What Llama's and Mixtral's ``config.json`` say alike."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
    }


def hf_names(cfg: ModelConfig) -> dict[str, str | list[str]] | None:
    """``{the model's parameter name: LlamaForCausalLM's}`` for every parameter (or
    MixtralForCausalLM's, where a stacked expert weight ``[n_experts, ...]`` is named by
    the list of its experts' names, ``experts.{e}.w1.weight`` ...); None when the model has
    no Hugging Face architecture."""
    if hf_unavailable(cfg) is not None:
        return None
    with torch.device("meta"):
        names = list(Transformer(cfg).state_dict())
    out: dict[str, str | list[str]] = {}
    for name in names:
        stacked = re.fullmatch(_MIXTRAL_EXPERTS, name)
        if stacked:
            out[name] = [f"model.layers.{stacked[1]}.block_sparse_moe.experts.{e}."
                         f"{stacked[2]}.weight" for e in range(cfg.n_experts)]
            continue
        for pattern, repl in [_MIXTRAL_ROUTER, *_LLAMA_NAMES]:
            new, n = re.subn(rf"^{pattern}$", repl, name)
            if n:
                out[name] = new
                break
        else:
            raise AssertionError(f"no Hugging Face name for the parameter {name!r}")
    return out


def hf_attachments(cfg: ModelConfig) -> dict[str, bytes]:
    """What every checkpoint carries for ``ckpt export --format hf``: ``config.json`` and
    ``hf_export.json``; when the model has no Hugging Face architecture, ``hf_export.json``
    alone, saying why (:func:`hf_unavailable`, the line the export is refused with)."""
    config, names = hf_config(cfg), hf_names(cfg)
    if config is None or names is None:
        return {HF_EXPORT_NAME: json.dumps({"select": HF_SELECT,
                                            "refused": hf_unavailable(cfg)}).encode() + b"\n"}
    return {HF_CONFIG_NAME: json.dumps(config, indent=2).encode() + b"\n",
            HF_EXPORT_NAME: json.dumps({"select": HF_SELECT, "names": names},
                                       indent=1).encode() + b"\n"}


_KEY = "checkpoint.initial_load"
# config.json's sizes -> the [model] key that must equal them, and the model's value.
_SIZES = (("vocab_size", "vocab_size", lambda c: c.vocab_size),
          ("hidden_size", "dim", lambda c: c.dim),
          ("num_hidden_layers", "n_layers", lambda c: c.n_layers),
          ("num_attention_heads", "n_heads", lambda c: c.n_heads),
          ("num_key_value_heads", "n_kv_heads", lambda c: c.kv_heads),
          ("intermediate_size", "ffn_dim", lambda c: c.hidden_ffn_dim),
          ("rms_norm_eps", "norm_eps", lambda c: c.norm_eps),
          ("rope_theta", "rope_theta", lambda c: c.rope_theta))
# A mixture of experts: Mixtral's intermediate_size is one expert's, and its experts.
_MOE_SIZES = (("intermediate_size", "moe_ffn_dim", lambda c: c.expert_ffn_dim),
              ("num_local_experts", "n_experts", lambda c: c.n_experts),
              ("num_experts_per_tok", "experts_per_token", lambda c: c.experts_per_token))
# What the reference model is, whatever its sizes (hf_config writes these values).
_FIXED = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
          ("tie_word_embeddings", False))


def _sizes(cfg: ModelConfig) -> tuple:
    """The sizes a folder must share with ``cfg``: :data:`_SIZES`, and for a mixture of
    experts :data:`_MOE_SIZES` in place of the MLP's."""
    if not cfg.n_experts:
        return _SIZES
    return tuple(s for s in _SIZES if s[0] != "intermediate_size") + _MOE_SIZES


def _folder_values(config: Mapping[str, Any], sizes: tuple) -> dict[str, Any]:
    """config.json's values for ``sizes``, with transformers' defaults: as many
    key/value heads as query heads; ``rope_theta`` at the top (transformers < 5) or in
    ``rope_parameters`` (5)."""
    out = {key: config.get(key) for key, _, _ in sizes}
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = config.get("num_attention_heads")
    rope = config.get("rope_parameters")
    if out["rope_theta"] is None and isinstance(rope, dict):
        out["rope_theta"] = rope.get("rope_theta")
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def check_hf_config(cfg: ModelConfig, config: Mapping[str, Any], where: str) -> None:
    """Refuse a Hugging Face ``config.json`` (read from ``where``) whose model is not
    ``cfg``'s: one :class:`ConfigError` line naming every field that differs with both
    values and the overrides that fix them, or what the reference model cannot be (another
    architecture, biases, tied embeddings, scaled rotary embeddings). A head size other
    than ``dim / n_heads`` is refused too. ``max_position_embeddings`` is not compared:
    no weight depends on it. A mixture of experts imports Mixtral folders (model_type
    'mixtral'), a dense model Llama ones."""
    kind, own = config.get("model_type"), "mixtral" if cfg.n_experts else "llama"
    if kind != own:
        what = (f"a mixture of experts (model.n_experts={cfg.n_experts}) imports Mixtral "
                f"folders only (model_type 'mixtral')" if cfg.n_experts else
                "the reference model imports Llama-architecture folders only (model_type "
                "'llama'; a Mixtral folder into model.n_experts > 0)")
        raise ConfigError(f"{_KEY}: {where} is a {kind!r} model, and {what}; load other "
                          f"models with ckpt.load_hf into their own class", key=_KEY)
    for key, value in _FIXED:
        if not _equal(config.get(key, value), value):
            raise ConfigError(f"{_KEY}: {where} has {key}={json.dumps(config.get(key))}, but "
                              f"the reference model has {key}={json.dumps(value)} (no biases, an "
                              f"untied output projection, a SwiGLU MLP); import another folder",
                              key=_KEY)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) \
        else rope
    if rope_type != "default":
        raise ConfigError(f"{_KEY}: {where} scales its rotary embeddings (rope type "
                          f"{json.dumps(rope_type)}), which the reference model does not; "
                          f"import a folder with rope type 'default'", key=_KEY)
    sizes = _sizes(cfg)
    values = _folder_values(config, sizes)
    wrong = [(key, mkey, values[key], get(cfg)) for key, mkey, get in sizes
             if not _equal(values[key], get(cfg))]
    head_dim = config.get("head_dim")
    if head_dim is not None and not wrong and not _equal(head_dim, cfg.head_dim):
        raise ConfigError(f"{_KEY}: {where} has head_dim={head_dim}, but the reference "
                          f"model's head size is model.dim / model.n_heads = {cfg.head_dim}; "
                          f"import another folder", key=_KEY)
    if wrong:
        said = "; ".join(f"{key}={json.dumps(value)} but model.{mkey}={json.dumps(ours)}"
                         for key, mkey, value, ours in wrong)
        fix = " ".join(f"--model.{mkey}={json.dumps(value)}" for _, mkey, value, _ in wrong)
        raise ConfigError(f"{_KEY}: {where} does not match [model]: {said}; set them to "
                          f"the folder's ({fix})", key=_KEY)


def import_hf(path: str, cfg: ModelConfig, model: Any, *,
              storage_options: dict[str, Any] | None = None,
              process_group=None) -> tuple[HFLoadReport, dict[str, bytes]]:
    """Read the Hugging Face folder ``path`` into ``model`` (a
    :class:`trainer.parallelize.ParallelModel`, any layout): ``config.json`` is checked
    against ``cfg`` first (:func:`check_hf_config`), then each rank reads only its own
    shards (:func:`ckpt.load_hf`, the names :func:`hf_names` gives, inverted). Returns the
    load's report and the folder's tokenizer and generation files (``{name: bytes}``, for
    the saves' attachments).

    Collective over ``process_group`` (None: the world): every rank calls it, after the
    model is built and before training; one rank's failure raises on every rank."""
    names = hf_names(cfg)
    if names is None:
        fix = ("set model.activation='swiglu' (Llama's and Mixtral's MLP)"
               if cfg.activation != "swiglu" else
               "set model.moe_every=1 and model.n_shared_experts=0 (Mixtral's)")
        raise ConfigError(f"{_KEY}: this model has no Hugging Face architecture to import "
                          f"({hf_unavailable(cfg).split(':')[0]}); {fix}", key=_KEY)
    error: BaseException | None = None
    try:
        folder = HFFolder(path, storage_options)
        check_hf_config(cfg, folder.read_config(), folder.describe(HF_CONFIG_NAME))
        extra = folder.extra_files()
    except Exception as exc:  # noqa: BLE001 - agreed below, then raised
        error = exc
    if not Agreement(cpu_group(process_group)).all(error is None):
        raise error or ConfigError(f"{_KEY}: reading {path} failed on another rank (see "
                                   f"its error)", key=_KEY)
    state = model.model_state_dict()  # this rank's shards, the parameters' own memory
    report = load_hf(state, folder, names=names, process_group=process_group)
    return report, extra


def carried_attachments(storage: Storage, manifest: Manifest, made: Mapping[str, Any]
                        ) -> dict[str, bytes]:
    """The attachments of the version ``manifest`` (under ``storage``) that this run does
    not make itself (not in ``made``, and never ``config.json`` or ``hf_export.json``,
    which describe this run's model): the tokenizer files an import attached, read once on
    a resume so that every later save carries them too."""
    own = {*made, HF_CONFIG_NAME, HF_EXPORT_NAME}
    return {name: read_from(storage, manifest, name)
            for name in sorted(manifest.attachments) if name not in own}
