"""The config tree's types: one dataclass per section, each validating itself.

Every field carries a one-line help text (``field(metadata={"help": ...})``); every section
coerces its field types and validates in ``__post_init__``, raising :class:`ConfigError`
whose message starts with the dotted key (``training.lr: ...``) and says how to fix it.
Reading TOML files and ``--section.key=value`` overrides is :mod:`trainer.config`'s part.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckpt.cadence import Interval

__all__ = [
    "ConfigError",
    "ModelConfig",
    "TrainingConfig",
    "ParallelConfig",
    "DP_MODES",
    "PP_SCHEDULES",
    "DataConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "FaultConfig",
    "Config",
]


class ConfigError(ValueError):
    """A config file, override or value is invalid. ``key`` is the dotted key at fault."""

    def __init__(self, message: str, *, key: str | None = None, located: bool = False):
        super().__init__(message)
        self.key = key
        self.located = located  # the message already says where the value was set


def _f(default: Any, help: str) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


class _Section:
    """Base of every section: coerces field types, then runs the section's ``_validate``."""

    _section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            key = f"{self._section}.{f.name}"
            setattr(self, f.name, coerce(getattr(self, f.name), hints[f.name], key))
        self._validate()

    def _validate(self) -> None:
        pass

    def _fail(self, name: str, problem: str, fix: str = "") -> typing.NoReturn:
        key = f"{self._section}.{name}"
        raise ConfigError(f"{key}: {problem}" + (f"; {fix}" if fix else ""), key=key)

    def _at_least(self, name: str, low: float, what: str = "") -> None:
        value = getattr(self, name)
        if value < low:
            self._fail(name, f"must be >= {low}, got {value!r}", what or f"set it to {low} or more")

    def _choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), choices, n=1)
            self._fail(name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}",
                       f"did you mean {hint[0]!r}?" if hint else "")


@dataclass
class ModelConfig(_Section):
    """Shape of the reference decoder-only transformer (same fields as trainer.model's)."""

    _section: ClassVar[str] = "model"
    vocab_size: int = _f(256, "Number of token ids; every data token must be < vocab_size.")
    dim: int = _f(64, "Hidden size (d_model); a multiple of n_heads.")
    n_layers: int = _f(2, "Number of transformer blocks.")
    n_heads: int = _f(4, "Attention heads; head size dim / n_heads must be even (rotary).")
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

    def num_params(self) -> int:
        """Parameter count: untied embedding and output, attention 4 d^2, MLP 2-3 d f, norms."""
        d, f, v = self.dim, self.hidden_ffn_dim, self.vocab_size
        block = 4 * d * d + (3 if self.activation == "swiglu" else 2) * d * f + 2 * d
        return 2 * v * d + self.n_layers * block + d


@dataclass
class TrainingConfig(_Section):
    """Optimizer, schedule, batch and run length. Optimizer is AdamW."""

    _section: ClassVar[str] = "training"
    steps: int = _f(100, "Optimizer steps to run in total (a resumed run stops at the same step).")
    global_batch_size: int = _f(16, "Sequences per optimizer step, summed over all dp ranks.")
    seq_len: int = _f(32, "Tokens per training sequence (inputs; targets are shifted by one).")
    lr: float = _f(3e-3, "Peak learning rate, reached after warmup_steps.")
    min_lr: float = _f(3e-4, "Learning rate at the end of the cosine decay.")
    warmup_steps: int = _f(10, "Linear warmup steps from 0 to lr.")
    lr_decay_steps: int | None = _f(None, "Step where cosine decay reaches min_lr; None = steps.")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay.")
    betas: tuple[float, float] = _f((0.9, 0.95), "AdamW (beta1, beta2).")
    eps: float = _f(1e-8, "AdamW epsilon.")
    grad_clip: float = _f(1.0, "Max global gradient norm; 0 disables clipping.")
    grad_accum_steps: int = _f(1, "Micro-steps whose gradients are summed per optimizer step.")
    seed: int = _f(0, "Seed for model init and any training randomness.")
    mixed_precision: str = _f("fp32", "'fp32', or 'bf16' compute with fp32 master weights.")
    device: str = _f("auto", "'cpu', 'cuda', or 'auto' (cuda when available).")
    log_every: int = _f(10, "Log loss and throughput every this many steps.")
    override_schedule_on_resume: bool = _f(
        False, "On resume, apply this config's LR schedule (lr, min_lr, warmup_steps, "
        "lr_decay_steps) from the resumed step instead of the checkpoint's.")

    def _validate(self) -> None:
        for name in ("steps", "global_batch_size", "seq_len", "grad_accum_steps", "log_every"):
            self._at_least(name, 1)
        self._at_least("warmup_steps", 0)
        if self.lr_decay_steps is not None:
            self._at_least("lr_decay_steps", 1, "set it >= 1 or leave it unset for training.steps")
        if not self.lr > 0:
            self._fail("lr", f"must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            self._fail("min_lr", f"must be in [0, training.lr={self.lr}], got {self.min_lr}")
        self._at_least("weight_decay", 0)
        if not all(0 <= b < 1 for b in self.betas):
            self._fail("betas", f"each beta must be in [0, 1), got {list(self.betas)}",
                       "e.g. [0.9, 0.95]")
        if not self.eps > 0:
            self._fail("eps", f"must be > 0, got {self.eps}")
        self._at_least("grad_clip", 0, "use 0 to disable clipping")
        if self.global_batch_size % self.grad_accum_steps:
            self._fail("global_batch_size",
                       f"{self.global_batch_size} is not divisible by "
                       f"training.grad_accum_steps={self.grad_accum_steps}",
                       "make the batch a multiple of grad_accum_steps")
        self._choice("mixed_precision", ("fp32", "bf16"))
        self._choice("device", ("cpu", "cuda", "auto"))

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): linear warmup, cosine to min_lr."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        horizon = self.lr_decay_steps if self.lr_decay_steps is not None else self.steps
        span = max(1, horizon - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def resolved_device(self) -> str:
        """``device`` with 'auto' resolved: 'cuda' when torch sees a GPU, else 'cpu'."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


DP_MODES = ("fsdp", "ddp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass
class ParallelConfig(_Section):
    """The parallel layout: a (pp, dp, tp) device mesh plus how each axis is used.

    The dp axis may be split into ``dp_replicate x dp_shard`` (HSDP, hybrid sharded data
    parallel, as torchtitan's ParallelDims): FSDP shards parameters, gradients and optimizer
    state over the ``dp_shard`` ranks of a replica and the ``dp_replicate`` replicas hold the
    same shards. ``dp = dp_replicate * dp_shard`` always; ``dp`` alone (the default
    ``dp_replicate = 1``) is plain FSDP over all dp ranks, ``dp_shard = dp``. Give any two of
    (dp, dp_replicate, dp_shard), or dp_replicate alone and let dp be the rest of the world.

    The one layout type of ``trainer/``: the ``[parallel]`` config section, what
    :func:`trainer.mesh.build_mesh` and :func:`trainer.parallelize.build_parallel_model` take,
    and what the layout planner evaluates. Its rules live here only: single-field rules in
    ``__post_init__``, rules against the model and the batch in :meth:`check`, rules against
    the world size in :meth:`resolved`. Every error is a :class:`ConfigError` whose message
    starts with the dotted key at fault. ``dp = -1``, ``dp_shard = -1`` and
    ``n_microbatches = 0`` mean "not decided yet"; :meth:`resolved` makes them concrete
    (``dp_shard`` as soon as ``dp`` is known, ``dp`` as soon as both its factors are).
    """

    _section: ClassVar[str] = "parallel"
    pp: int = _f(1, "Pipeline-parallel degree (stages).")
    dp: int = _f(-1, "Data-parallel degree, dp_replicate * dp_shard; -1 = world // (pp * tp).")
    dp_replicate: int = _f(1, "HSDP: replicas of the dp axis (e.g. nodes); > 1 needs dp_mode='fsdp'.")
    dp_shard: int = _f(-1, "HSDP: ranks each replica shards over; -1 = dp // dp_replicate.")
    tp: int = _f(1, "Tensor-parallel degree; keep it within one node.")
    dp_mode: str = _f("fsdp", "'fsdp' (FSDP2, sharded) or 'ddp' (replicated) on the dp axis.")
    pp_schedule: str = _f("1f1b", "'gpipe', '1f1b' or 'interleaved1f1b'.")
    n_microbatches: int = _f(0, "Pipeline micro-batches per step; 0 = 2 * pp.")
    sequence_parallel: bool = _f(False, "Shard norms/dropout activations over tp (needs tp > 1).")
    stages_per_rank: int = _f(1, "Pipeline stages per pp rank; > 1 only for interleaved1f1b.")

    def _validate(self) -> None:
        self._at_least("pp", 1)
        self._at_least("tp", 1)
        if self.dp != -1 and self.dp < 1:
            self._fail("dp", f"must be >= 1 or -1, got {self.dp}",
                       "use -1 for the rest of the world")
        self.pp_schedule = self.pp_schedule.lower()
        self._choice("dp_mode", DP_MODES)
        self._settle_dp_split()
        self._choice("pp_schedule", PP_SCHEDULES)
        self._at_least("n_microbatches", 0, "use 0 for 2 * pp")
        self._at_least("stages_per_rank", 1)
        if self.pp_schedule == "interleaved1f1b" and self.pp > 1 and self.stages_per_rank < 2:
            self._fail("stages_per_rank", "interleaved1f1b needs >= 2 stages per rank",
                       "set parallel.stages_per_rank=2 or use parallel.pp_schedule='1f1b'")
        if self.pp_schedule != "interleaved1f1b" and self.stages_per_rank != 1:
            self._fail("stages_per_rank", f"is {self.stages_per_rank} but only "
                       "parallel.pp_schedule='interleaved1f1b' runs several stages per rank",
                       "set it to 1 or switch the schedule")
        m = self.n_microbatches
        if self.pp > 1 and m:
            if self.pp_schedule == "1f1b" and m < self.pp:
                self._fail("n_microbatches", f"1f1b needs >= parallel.pp={self.pp} micro-batches, "
                           f"got {m}", f"set it to {self.pp} or more (more = smaller bubble)")
            rounds = max(1, m // self.pp)
            if self.pp_schedule == "interleaved1f1b" and m % rounds:
                self._fail("n_microbatches", f"interleaved1f1b needs a multiple of "
                           f"{rounds} (= n_microbatches // pp), got {m}",
                           f"use a multiple of parallel.pp={self.pp}")

    def _settle_dp_split(self) -> None:
        """Check ``dp = dp_replicate * dp_shard`` and fill in whichever of them is derivable
        (``dp_shard`` from dp, or ``dp`` from both factors); with both dp and dp_shard -1
        they wait for :meth:`resolved`."""
        self._at_least("dp_replicate", 1, "use 1 for plain FSDP/DDP over the whole dp axis")
        if self.dp_shard != -1 and self.dp_shard < 1:
            self._fail("dp_shard", f"must be >= 1 or -1, got {self.dp_shard}",
                       "use -1 for parallel.dp // parallel.dp_replicate")
        if self.dp_replicate > 1 and self.dp_mode != "fsdp":
            self._fail("dp_replicate", f"is {self.dp_replicate} but HSDP needs "
                       f"parallel.dp_mode='fsdp' (with {self.dp_mode!r} every dp rank already "
                       "holds a full replica)", "set parallel.dp_mode='fsdp' or "
                       "parallel.dp_replicate=1")
        r, s = self.dp_replicate, self.dp_shard
        if self.dp == -1:
            if s != -1:
                self.dp = r * s
            return
        if s == -1:
            if self.dp % r:
                self._fail("dp_replicate", f"{r} does not divide parallel.dp={self.dp} "
                           "(dp = dp_replicate * dp_shard)",
                           "pick a dp_replicate that divides dp")
            self.dp_shard = self.dp // r
        elif r * s != self.dp:
            self._fail("dp", f"is {self.dp} but parallel.dp_replicate * parallel.dp_shard = "
                       f"{r} * {s} = {r * s}", f"set parallel.dp={r * s}, or leave "
                       "parallel.dp_shard unset (-1) to derive it from dp")

    @property
    def hsdp(self) -> bool:
        """FSDP with replicas: the dp axis is a 2-D (dp_replicate, dp_shard) mesh."""
        return self.dp_mode == "fsdp" and self.dp_replicate > 1

    @property
    def num_microbatches(self) -> int:
        """``n_microbatches`` with 0 resolved (2 * pp, or 1 without pipelining)."""
        return self.n_microbatches or (2 * self.pp if self.pp > 1 else 1)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def world_size(self) -> int:
        """``pp * dp * tp``; needs a concrete ``dp`` (see :meth:`resolved`)."""
        if self.dp == -1:
            self._fail("dp", "is -1 (unresolved)", "call resolved(world_size) first")
        return self.pp * self.dp * self.tp

    def check(self, model: Any, *, global_batch_size: int | None = None,
              grad_accum_steps: int = 1, seq_len: int | None = None) -> None:
        """Raise :class:`ConfigError` naming the key at fault if this layout cannot train
        ``model`` (any object with ``n_heads``, ``dim``, ``hidden_ffn_dim`` and ``n_layers``)
        on ``global_batch_size`` sequences of ``seq_len`` tokens per step. Batch rules need a
        concrete ``dp`` and are skipped while it is -1. Pure: no process group needed."""
        for what, n in (("model.n_heads", model.n_heads), ("model.dim", model.dim),
                        ("the MLP hidden size (model.ffn_dim)", model.hidden_ffn_dim)):
            if n % self.tp:
                self._fail("tp", f"{self.tp} does not divide {what}={n}",
                           "choose a tp that divides it")
        if model.n_layers < self.num_stages:
            self._fail("pp", f"{self.num_stages} pipeline stages (pp * stages_per_rank) but "
                       f"model.n_layers={model.n_layers}", "use fewer stages or more layers")
        if self.sequence_parallel and self.tp == 1:
            self._fail("sequence_parallel", "needs parallel.tp > 1",
                       "set it to false or raise parallel.tp")
        if self.sequence_parallel and seq_len is not None and seq_len % self.tp:
            self._fail("sequence_parallel", f"shards the sequence over parallel.tp={self.tp}, "
                       f"which does not divide training.seq_len={seq_len}",
                       "change tp or the sequence length")
        if self.dp_mode == "ddp" and self.tp > 1:
            self._fail("dp_mode", f"'ddp' does not compose with tensor parallelism "
                       f"(parallel.tp={self.tp})", "use parallel.dp_mode='fsdp' or parallel.tp=1")
        if global_batch_size is None or self.dp == -1:
            return
        per_rank = self.dp * grad_accum_steps
        if global_batch_size % per_rank:
            _raise("training.global_batch_size",
                   f"{global_batch_size} is not divisible by dp * grad_accum_steps = "
                   f"{self.dp} * {grad_accum_steps}", f"use a multiple of {per_rank}")
        micro = global_batch_size // per_rank
        if micro % self.num_microbatches:
            self._fail("n_microbatches",
                       f"the per-rank micro-batch of {micro} sequences does not split into "
                       f"{self.num_microbatches} micro-batches",
                       "make global_batch_size / (dp * grad_accum_steps) a multiple of it")

    def resolved(self, world_size: int) -> ParallelConfig:
        """A copy with ``dp`` and ``n_microbatches`` concrete for ``world_size`` ranks.
        Raises :class:`ConfigError` when pp * dp * tp cannot equal ``world_size``."""
        if world_size % (self.pp * self.tp):
            self._fail("tp" if self.tp > 1 else "pp",
                       f"world size {world_size} is not divisible by pp * tp = "
                       f"{self.pp} * {self.tp}", "launch pp * dp * tp ranks")
        dp = world_size // (self.pp * self.tp) if self.dp == -1 else self.dp
        if self.pp * dp * self.tp != world_size:
            split = (f" (dp = dp_replicate * dp_shard = {self.dp_replicate} * {self.dp_shard})"
                     if self.dp_shard != -1 and self.dp_replicate > 1 else "")
            self._fail("dp", f"pp * dp * tp = {self.pp} * {dp} * {self.tp} != world size "
                       f"{world_size}{split}", "set parallel.dp=-1 and parallel.dp_shard=-1 "
                       "to use the rest of the world" if split else
                       "set parallel.dp=-1 to use the rest of the world")
        if dp % self.dp_replicate:
            self._fail("dp_replicate", f"{self.dp_replicate} does not divide the dp degree "
                       f"{dp} (world size {world_size} / (pp * tp))",
                       "pick a dp_replicate that divides it")
        return dataclasses.replace(self, dp=dp, dp_shard=dp // self.dp_replicate,
                                   n_microbatches=self.num_microbatches)


@dataclass
class DataConfig(_Section):
    """Where training tokens come from. Sample order depends only on (seed, sample index)."""

    _section: ClassVar[str] = "data"
    kind: str = _f("synthetic", "'synthetic' (learnable Markov chain) or 'tokens' (.bin file).")
    path: str = _f("", "Token file for kind='tokens': raw little-endian ids, no header.")
    token_dtype: str = _f("uint16", "Integer type of the token file: 'uint16' or 'uint32'.")
    seed: int = _f(0, "Seed of the sample order (and of the synthetic chain).")
    synthetic_branching: int = _f(4, "Synthetic: successors each token can have (lower = easier).")
    synthetic_noise: float = _f(0.05, "Synthetic: probability a token is uniform random instead.")

    def _validate(self) -> None:
        self._choice("kind", ("synthetic", "tokens"))
        self._choice("token_dtype", ("uint16", "uint32"))
        if self.kind == "tokens" and not self.path:
            self._fail("path", "is required when data.kind='tokens'",
                       "set it to a .bin file of token ids")
        self._at_least("seed", 0)
        self._at_least("synthetic_branching", 1)
        if not 0 <= self.synthetic_noise <= 1:
            self._fail("synthetic_noise", f"must be in [0, 1], got {self.synthetic_noise}")


@dataclass
class CheckpointConfig(_Section):
    """Where, when and how checkpoints are written and which one is loaded."""

    _section: ClassVar[str] = "checkpoint"
    root: str = _f("", "Directory or URL (file://, s3://, memory://); empty = no checkpoints.")
    interval: str = _f("auto", "'auto' (Young/Daly), steps like '50', or time like '30sec', '5m'.")
    load_step: int | None = _f(None, "Step to resume from; None = newest committed checkpoint.")
    keep_last: int = _f(3, "Committed checkpoints to keep; 0 = keep all.")
    keep_every: int = _f(0, "Also keep every checkpoint whose step is a multiple; 0 = off.")
    async_save: bool = _f(True, "Persist in the background; training stalls only to stage.")
    verify: str = _f("full", "Check on load: 'full' (checksums), 'size', or 'none'.")
    mtbf_hours: float = _f(24.0, "Prior mean time between failures of the job, for 'auto'.")
    overhead_budget: float = _f(0.01, "Target fraction of time spent saving, for 'auto'.")
    storage_options: dict[str, Any] = _f({}, "Extra fsspec options, e.g. {endpoint_url = ...}.")
    resume: bool = _f(True, "Resume from root when it holds a checkpoint.")
    allow_fresh_start_over_damaged: bool = _f(
        False, "Start from step 0 when every checkpoint under root is damaged (else refuse).")
    fail_on_error: bool = _f(False, "Stop the job when a save fails instead of alerting.")
    local_root: str = _f("", "Fast local tier on each node (NVMe, /dev/shm; '{node}' = node "
                             "index), saved more often than root; empty = off.")
    local_interval: str = _f("auto", "The local tier's interval, same forms as interval "
                                     "(used only with local_root).")
    local_keep_last: int = _f(2, "Local checkpoints kept on each node (>= 1).")
    node_loss_mtbf_hours: float = _f(
        0.0, "With local_root: prior mean time between node losses, for root's 'auto' "
             "(mtbf_hours is the local tier's); 0 = mtbf_hours.")

    def _validate(self) -> None:
        try:
            Interval.parse(self.interval)
        except ValueError as exc:
            self._fail("interval", str(exc))
        try:
            Interval.parse(self.local_interval)
        except ValueError as exc:
            self._fail("local_interval", str(exc))
        self._at_least("local_keep_last", 1, "a local tier keeps at least its newest step")
        if self.node_loss_mtbf_hours != 0 and self.node_loss_mtbf_hours < self.mtbf_hours:
            self._fail("node_loss_mtbf_hours",
                       f"{self.node_loss_mtbf_hours} is below mtbf_hours={self.mtbf_hours}, "
                       f"but node losses are a subset of all failures",
                       "set it >= mtbf_hours, or 0 to use mtbf_hours")
        if self.local_root:
            if not self.root:
                self._fail("local_root", "is set but root is empty",
                           "the local tier sits under a durable one: set checkpoint.root too")
            if _same_folder(self.local_root.replace("{node}", "0"), self.root):
                self._fail("local_root", f"{self.local_root!r} is checkpoint.root={self.root!r} "
                                         f"or overlaps it",
                           "give the local tier its own folder on fast node-local storage "
                           "(e.g. /dev/shm/ckpt)")
        if self.load_step is not None:
            self._at_least("load_step", 0, "leave it unset to load the newest checkpoint")
        self._at_least("keep_last", 0, "use 0 to keep all")
        self._at_least("keep_every", 0, "use 0 to disable")
        self._choice("verify", ("full", "size", "none"))
        if not self.mtbf_hours > 0:
            self._fail("mtbf_hours", f"must be > 0, got {self.mtbf_hours}")
        if not 0 < self.overhead_budget < 1:
            self._fail("overhead_budget", f"must be in (0, 1), got {self.overhead_budget}",
                       "e.g. 0.01 for 1%")

    @property
    def enabled(self) -> bool:
        return bool(self.root)


def _same_folder(a: str, b: str) -> bool:
    """Do two roots name the same place (or one inside the other)? URLs compare as text."""
    import os

    if "://" in a or "://" in b:
        a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    else:
        a = os.path.join(os.path.realpath(os.path.expanduser(a)), "")
        b = os.path.join(os.path.realpath(os.path.expanduser(b)), "")
    return a.startswith(b) or b.startswith(a)


@dataclass
class MetricsConfig(_Section):
    """Prometheus endpoint and a JSONL log of step metrics."""

    _section: ClassVar[str] = "metrics"
    port: int = _f(0, "Base Prometheus /metrics port: each rank serves port + LOCAL_RANK; 0 = off.")
    host: str = _f("0.0.0.0", "Address the metrics servers bind.")
    jsonl_path: str = _f("", "Append one JSON line per event (rank 0) here; empty = off.")
    stall_factor: float = _f(20.0, "TrainingStalled after this many typical step times without a step.")
    stall_min_seconds: float = _f(60.0, "TrainingStalled never before this long without a step.")
    startup_seconds: float = _f(900.0, "TrainingStalled allowance before the first step (build, resume).")
    age_slack_seconds: float = _f(300.0, "CheckpointTooOld after 3 intervals plus this long.")
    linger_seconds: float = _f(15.0, "On a hang, keep serving this long before exiting (one scrape).")

    def _validate(self) -> None:
        if not 0 <= self.port <= 65535:
            self._fail("port", f"must be in [0, 65535], got {self.port}", "use 0 to disable")
        if not self.stall_factor > 1:
            self._fail("stall_factor", f"must be > 1, got {self.stall_factor}", "e.g. 20")
        for name in ("stall_min_seconds", "startup_seconds", "age_slack_seconds",
                     "linger_seconds"):
            self._at_least(name, 0)


@dataclass
class FaultConfig(_Section):
    """Failure detection: hangs, NaN/spiking loss, stragglers, preemption."""

    _section: ClassVar[str] = "fault"
    hang_timeout_seconds: float = _f(300.0, "Abort when no step completes for this long; 0 = off.")
    nan_policy: str = _f("skip", "On NaN/inf or spiking loss: 'skip', 'rollback' or 'stop'.")
    spike_factor: float = _f(10.0, "Loss > factor * recent mean counts as a spike; 0 = off.")
    spike_window: int = _f(20, "Steps in the running mean used for spike detection.")
    max_skips: int = _f(10, "Consecutive skipped steps before the job stops.")
    straggler_factor: float = _f(2.0, "Report ranks slower than factor * median step; 0 = off.")
    handle_preemption: bool = _f(True, "On SIGTERM/SIGUSR1, save a checkpoint, then exit.")
    inject_nan_step: int = _f(0, "Testing: make the loss of this step NaN (1-based); 0 = off.")

    def _validate(self) -> None:
        self._at_least("hang_timeout_seconds", 0, "use 0 to disable")
        self._choice("nan_policy", ("skip", "rollback", "stop"))
        if self.spike_factor != 0 and self.spike_factor <= 1:
            self._fail("spike_factor", f"must be > 1 or 0 (off), got {self.spike_factor}")
        self._at_least("spike_window", 1)
        self._at_least("max_skips", 1)
        if self.straggler_factor != 0 and self.straggler_factor <= 1:
            self._fail("straggler_factor", f"must be > 1 or 0 (off), got {self.straggler_factor}")
        self._at_least("inject_nan_step", 0, "use 0 to disable")


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "training": TrainingConfig, "parallel": ParallelConfig,
    "data": DataConfig, "checkpoint": CheckpointConfig, "metrics": MetricsConfig,
    "fault": FaultConfig,
}


@dataclass
class Config:
    """The whole job. Cross-section rules are checked here; layout rules by
    :meth:`ParallelConfig.check` (against the model and batch) and
    :meth:`ParallelConfig.resolved` (against the world size)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        m, t = self.model, self.training
        if t.seq_len > m.max_seq_len:
            _raise("training.seq_len", f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
                   "raise model.max_seq_len or lower training.seq_len")
        self.parallel.check(m, global_batch_size=t.global_batch_size,
                            grad_accum_steps=t.grad_accum_steps, seq_len=t.seq_len)

    def resolved(self, world_size: int) -> Config:
        """A copy whose ``parallel`` is :meth:`ParallelConfig.resolved` for ``world_size``
        ranks, checked against the model and batch. Raises :class:`ConfigError`. Every rank
        calls it with the same input."""
        out = copy.deepcopy(self)
        out.parallel = self.parallel.resolved(world_size)
        out.__post_init__()
        return out

    @property
    def local_batch_size(self) -> int:
        """Sequences per optimizer step on one dp rank (needs a concrete ``parallel.dp``)."""
        if self.parallel.dp == -1:
            _raise("parallel.dp", "is -1 (unresolved)", "call Config.resolved(world_size) first")
        return self.training.global_batch_size // self.parallel.dp

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward on one dp rank: local batch / grad_accum_steps."""
        return self.local_batch_size // self.training.grad_accum_steps


def _raise(key: str, problem: str, fix: str) -> typing.NoReturn:
    raise ConfigError(f"{key}: {problem}; {fix}", key=key)


# ---------------------------------------------------------------- typing and parsing


def type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp).replace("typing.", ""))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; widen int->float and list->tuple."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(value, inner, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}",
                              key=key)
        return tuple(coerce(v, a, key) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}", key=key)
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, int) and not isinstance(value, bool) and key.endswith(
            ".interval"):
        return str(value)  # `interval = 50` in TOML means 50 steps
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r} "
                      f"({type(value).__name__})", key=key)
