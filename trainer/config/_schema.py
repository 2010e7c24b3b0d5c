"""The config tree: the small sections (``[training]``, ``[data]``, ``[metrics]``,
``[fault]``), the :class:`Config` that holds every section and checks the rules across them,
and :data:`SECTIONS`, the section names in file order.

Every field carries a one-line help text; every section coerces its field types and
validates in ``__post_init__``, raising :class:`ConfigError` whose message starts with the
dotted key (``training.lr: ...``) and says how to fix it. The section base is
:mod:`trainer.config._section`; the ``[model]``, ``[parallel]`` and ``[checkpoint]`` sections
have their own modules; reading TOML files and overrides is :mod:`trainer.config._io`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import ClassVar, Iterable

import torch

from trainer.config._checkpoint import CheckpointConfig
from trainer.config._fault_tolerance import QUORUM_TIMEOUT_MARGIN_SECONDS, FaultToleranceConfig
from trainer.config._model import ModelConfig
from trainer.config._parallel import ParallelConfig
from trainer.config._section import Section, config_field as _f, fail_key

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "recomputed_layers",
    "TrainingConfig",
    "DataConfig",
    "MetricsConfig",
    "FaultConfig",
    "Config",
    "SECTIONS",
    "PROCESS_GROUP_TIMEOUT_MARGIN_SECONDS",
]


ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


def recomputed_layers(mode: str, every: int, layer_ids: Iterable[int]) -> frozenset[int]:
    """Which of ``layer_ids`` (global block indices) recompute their activations in backward
    under ``training.activation_checkpointing = mode``: none, all ('full'), or the blocks
    ``i`` with ``(i + 1) % every == 0`` ('selective', torchtitan's layer-level selective
    checkpointing by global index, so a pipeline split does not change the choice). The one
    definition the trainer applies and the layout planner counts."""
    if mode == "full":
        return frozenset(layer_ids)
    if mode == "selective":
        return frozenset(i for i in layer_ids if (i + 1) % every == 0)
    assert mode == "none", mode
    return frozenset()


@dataclass
class TrainingConfig(Section):
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
    deterministic: bool = _f(
        True, "Deterministic kernels (torch.use_deterministic_algorithms, "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8, no cuDNN benchmark): what a bit-exact resume on "
        "GPU needs; false trades that for speed.")
    log_every: int = _f(10, "Log loss and throughput every this many steps.")
    activation_checkpointing: str = _f(
        "none", "Recompute blocks' activations in backward instead of keeping them: 'none', "
        "'full' (every block) or 'selective' (every activation_checkpointing_every-th block).")
    activation_checkpointing_every: int = _f(
        2, "With activation_checkpointing='selective': recompute the blocks whose global index "
        "i has (i + 1) % k == 0.")
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
        self._choice("activation_checkpointing", ACTIVATION_CHECKPOINTING)
        self._at_least("activation_checkpointing_every", 1)

    def recomputed_layers(self, n_layers: int) -> frozenset[int]:
        """Global indices of the blocks whose activations are recomputed in backward:
        :func:`recomputed_layers` of this section's two keys."""
        return recomputed_layers(self.activation_checkpointing,
                                 self.activation_checkpointing_every, range(n_layers))

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
        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class DataConfig(Section):
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
class MetricsConfig(Section):
    """Prometheus endpoint and a JSONL log of step metrics."""

    _section: ClassVar[str] = "metrics"
    port: int = _f(0, "Base Prometheus /metrics port: each rank serves port + LOCAL_RANK; 0 = off.")
    host: str = _f("0.0.0.0", "Address the metrics servers bind.")
    jsonl_path: str = _f("", "Append one JSON line per event (rank 0) here; empty = off.")
    stall_factor: float = _f(20.0, "TrainingStalled after this many typical step times without a step.")
    stall_min_seconds: float = _f(60.0, "TrainingStalled never before this long without a step.")
    startup_seconds: float = _f(900.0, "TrainingStalled allowance before the first step (build, resume).")
    age_slack_seconds: float = _f(300.0, "CheckpointTooOld after 3 intervals plus this long.")
    linger_seconds: float = _f(15.0, "After a hang, a lost lease or the run's end, keep serving this long before exiting; at least the scrape interval.")

    def _validate(self) -> None:
        if not 0 <= self.port <= 65535:
            self._fail("port", f"must be in [0, 65535], got {self.port}", "use 0 to disable")
        if not self.stall_factor > 1:
            self._fail("stall_factor", f"must be > 1, got {self.stall_factor}", "e.g. 20")
        for name in ("stall_min_seconds", "startup_seconds", "age_slack_seconds",
                     "linger_seconds"):
            self._at_least(name, 0)


@dataclass
class FaultConfig(Section):
    """Failure detection: hangs, NaN/spiking loss, stragglers, preemption."""

    _section: ClassVar[str] = "fault"
    hang_timeout_seconds: float = _f(300.0, "Abort when no step completes for this long; 0 = off.")
    blocking_save_grace_seconds: float = _f(
        3600.0, "Extra time the hang watchdog allows a blocking (final or preemption) save.")
    process_group_timeout_seconds: float | None = _f(
        None, "Timeout of the training process group's collectives (NCCL's watchdog); "
        "unset = hang + blocking-save grace + metrics linger + 60, so the hang watchdog "
        "acts first.")
    nan_policy: str = _f("skip", "On NaN/inf or spiking loss: 'skip', 'rollback' or 'stop'.")
    spike_factor: float = _f(10.0, "Loss > factor * recent mean counts as a spike; 0 = off.")
    spike_window: int = _f(20, "Steps in the running mean used for spike detection.")
    max_skips: int = _f(10, "Consecutive skipped steps before the job stops.")
    straggler_factor: float = _f(2.0, "Report ranks slower than factor * median step; 0 = off.")
    handle_preemption: bool = _f(True, "On SIGTERM/SIGUSR1, save a checkpoint, then exit 75.")
    preemption_grace_seconds: float = _f(
        0.0, "Time between a preemption or time-limit signal and the kill (Slurm: N of "
        "--signal=B:USR1@N); a warning when a save takes longer; 0 = not known.")
    inject_nan_step: int = _f(0, "Testing: make the loss of this step NaN (1-based); 0 = off.")
    inject_step_delay_seconds: float = _f(
        0.0, "Testing and demos: sleep this long in every step (a slower model); 0 = off.")

    def _validate(self) -> None:
        self._at_least("hang_timeout_seconds", 0, "use 0 to disable")
        self._at_least("blocking_save_grace_seconds", 0)
        self._at_least("preemption_grace_seconds", 0, "use 0 when it is not known")
        if self.process_group_timeout_seconds is not None:
            self._at_least("process_group_timeout_seconds", 1,
                           "or leave it unset to derive it from the hang timeout")
        self._choice("nan_policy", ("skip", "rollback", "stop"))
        if self.spike_factor != 0 and self.spike_factor <= 1:
            self._fail("spike_factor", f"must be > 1 or 0 (off), got {self.spike_factor}")
        self._at_least("spike_window", 1)
        self._at_least("max_skips", 1)
        if self.straggler_factor != 0 and self.straggler_factor <= 1:
            self._fail("straggler_factor", f"must be > 1 or 0 (off), got {self.straggler_factor}")
        self._at_least("inject_nan_step", 0, "use 0 to disable")
        self._at_least("inject_step_delay_seconds", 0, "use 0 to disable")


# Beyond the hang deadline: the watchdog polls every 5 s at most, then dumps the stacks of
# every thread and exits.
PROCESS_GROUP_TIMEOUT_MARGIN_SECONDS = 60.0

SECTIONS: dict[str, type] = {
    "model": ModelConfig, "training": TrainingConfig, "parallel": ParallelConfig,
    "data": DataConfig, "checkpoint": CheckpointConfig, "metrics": MetricsConfig,
    "fault": FaultConfig, "fault_tolerance": FaultToleranceConfig,
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
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self) -> None:
        m, t = self.model, self.training
        if t.seq_len > m.max_seq_len:
            fail_key("training.seq_len", f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
                   "raise model.max_seq_len or lower training.seq_len")
        self.parallel.check(m, global_batch_size=t.global_batch_size,
                            grad_accum_steps=t.grad_accum_steps, seq_len=t.seq_len)
        self._check_timeout_order()
        if self.fault_tolerance.enabled:
            self._check_fault_tolerance()

    def hang_deadline_seconds(self) -> float:
        """The longest a rank may wait in a collective while the hang watchdog has not yet
        acted: the hang timeout plus the grace of a blocking save (the final save, during
        which the other ranks also wait for rank 0's retention) plus the metrics linger
        before the watchdog exits (only with a metrics port)."""
        f, m = self.fault, self.metrics
        return (f.hang_timeout_seconds + f.blocking_save_grace_seconds
                + (m.linger_seconds if m.port else 0.0))

    def process_group_timeout_seconds(self) -> float:
        """``fault.process_group_timeout_seconds``, or derived from the hang deadline: the
        process group's own timeout must come after the hang watchdog, which dumps every
        stack, reports the hang and exits 124; NCCL's watchdog aborts without any of that."""
        explicit = self.fault.process_group_timeout_seconds
        if explicit is not None:
            return explicit
        return self.hang_deadline_seconds() + PROCESS_GROUP_TIMEOUT_MARGIN_SECONDS

    def _check_timeout_order(self) -> None:
        explicit = self.fault.process_group_timeout_seconds
        least = self.hang_deadline_seconds() + PROCESS_GROUP_TIMEOUT_MARGIN_SECONDS
        if explicit is not None and explicit < least:
            f, m = self.fault, self.metrics
            linger = (f" + metrics.linger_seconds ({m.linger_seconds:g}, metrics.port is set)"
                      if m.port else "")
            fail_key("fault.process_group_timeout_seconds",
                     f"{explicit:g} s would let the process group's own timeout (NCCL's "
                     f"watchdog) abort the job before the hang watchdog reports a hang (no "
                     f"stack dump, no hang event, not exit 124); it must be at least "
                     f"fault.hang_timeout_seconds ({f.hang_timeout_seconds:g}) + "
                     f"fault.blocking_save_grace_seconds ({f.blocking_save_grace_seconds:g})"
                     f"{linger} + {PROCESS_GROUP_TIMEOUT_MARGIN_SECONDS:g} = {least:g}",
                     f"set it to {least:g} or more, lower fault.hang_timeout_seconds or "
                     f"fault.blocking_save_grace_seconds, or leave it unset (derived)")

    def quorum_timeout_seconds(self) -> float:
        """``fault_tolerance.quorum_timeout_seconds``, or derived: a group waiting for a
        quorum must outwait a hung peer, whose heartbeat (sent by a thread of torchft's own,
        alive while Python hangs) stops only when its hang watchdog exits the process
        (after ``fault.hang_timeout_seconds``, plus ``metrics.linger_seconds`` with a
        metrics port) and the lighthouse then waits a heartbeat timeout."""
        ft = self.fault_tolerance
        return ft.quorum_timeout_seconds or max(60.0, self._least_quorum_timeout())

    def _least_quorum_timeout(self) -> float:
        f, m, ft = self.fault, self.metrics, self.fault_tolerance
        return (f.hang_timeout_seconds + (m.linger_seconds if m.port else 0.0)
                + ft.heartbeat_timeout_seconds + QUORUM_TIMEOUT_MARGIN_SECONDS)

    def _check_fault_tolerance(self) -> None:
        ft, par, f = self.fault_tolerance, self.parallel, self.fault
        groups = par.dp_replicate
        if ft.group_id >= groups:
            fail_key("fault_tolerance.group_id", f"{ft.group_id} is outside the "
                     f"parallel.dp_replicate={groups} replica groups",
                     f"use 0 .. {groups - 1}, or raise parallel.dp_replicate")
        if ft.min_replicas > groups:
            fail_key("fault_tolerance.min_replicas", f"{ft.min_replicas} exceeds the "
                     f"parallel.dp_replicate={groups} replica groups: no step would commit",
                     f"set it to {groups} or less")
        if f.nan_policy == "rollback":
            fail_key("fault.nan_policy", "'rollback' is not supported with "
                     "fault_tolerance.enabled (a rollback would have to move every replica "
                     "group back at once)", "use 'skip' or 'stop'")
        if self.checkpoint.local_root:
            fail_key("checkpoint.local_root", "a local tier is not supported with "
                     "fault_tolerance.enabled (healthy replica groups are the fast tier)",
                     "leave checkpoint.local_root empty")
        if f.hang_timeout_seconds > 0 and ft.timeout_seconds >= f.hang_timeout_seconds:
            fail_key("fault_tolerance.timeout_seconds", f"{ft.timeout_seconds:g} s is not "
                     f"below fault.hang_timeout_seconds ({f.hang_timeout_seconds:g}): a group "
                     f"waiting on a dead peer's all-reduce would be taken for hung",
                     "lower it or raise the hang timeout")
        least = self._least_quorum_timeout()
        if ft.quorum_timeout_seconds and ft.quorum_timeout_seconds < least:
            linger = (f" + metrics.linger_seconds ({self.metrics.linger_seconds:g})"
                      if self.metrics.port else "")
            fail_key("fault_tolerance.quorum_timeout_seconds",
                     f"{ft.quorum_timeout_seconds:g} s would give up on the quorum while a "
                     f"hung replica group still heartbeats, and every healthy group would "
                     f"exit with it; it must be at least fault.hang_timeout_seconds "
                     f"({f.hang_timeout_seconds:g}){linger} + "
                     f"fault_tolerance.heartbeat_timeout_seconds "
                     f"({ft.heartbeat_timeout_seconds:g}) + "
                     f"{QUORUM_TIMEOUT_MARGIN_SECONDS:g} = {least:g}",
                     f"set it to {least:g} or more, or 0 to derive it")

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
            fail_key("parallel.dp", "is -1 (unresolved)", "call Config.resolved(world_size) first")
        return self.training.global_batch_size // self.parallel.dp

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward on one dp rank: local batch / grad_accum_steps."""
        return self.local_batch_size // self.training.grad_accum_steps
