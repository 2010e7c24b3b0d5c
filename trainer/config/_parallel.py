"""The ``[parallel]`` section: the one layout type of ``trainer/`` and all of its rules
(the dp split into dp_replicate x dp_shard for HSDP, pipeline schedules, the checks against
the model, the batch and the world size)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from trainer.config._section import Section, config_field as _f, fail_key

__all__ = ["ParallelConfig", "DP_MODES", "PP_SCHEDULES"]


DP_MODES = ("fsdp", "ddp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass
class ParallelConfig(Section):
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

    Expert parallelism (``ep > 1``, a mixture-of-experts model) takes its ranks from the dp
    axis, as torchtitan does: ``ep`` divides ``dp_shard``, which splits into
    ``dp_shard_mod_ep x ep``; the routed experts are split over the ``ep`` ranks and
    FSDP-sharded over the ``dp_shard_mod_ep`` ones, everything else is sharded over all of
    ``dp_shard`` as without it (:mod:`trainer.expert_parallel`). The world size stays
    ``pp * dp * tp``.
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
    ep: int = _f(1, "Expert-parallel degree: experts split over ep of the dp_shard ranks; "
                    "divides model.n_experts and dp_shard.")

    def _validate(self) -> None:
        self._at_least("pp", 1)
        self._at_least("tp", 1)
        if self.dp != -1 and self.dp < 1:
            self._fail("dp", f"must be >= 1 or -1, got {self.dp}",
                       "use -1 for the rest of the world")
        self.pp_schedule = self.pp_schedule.lower()
        self._choice("dp_mode", DP_MODES)
        self._settle_dp_split()
        self._settle_ep()
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

    def _settle_ep(self) -> None:
        """``ep`` against the dp keys known so far (``dp_shard`` again in :meth:`resolved`)."""
        self._at_least("ep", 1, "use 1 for no expert parallelism")
        if self.ep == 1:
            return
        if self.dp_mode != "fsdp":
            self._fail("ep", f"is {self.ep} but expert parallelism composes with FSDP2 only "
                       f"(parallel.dp_mode={self.dp_mode!r})", "set parallel.dp_mode='fsdp' "
                       "or parallel.ep=1")
        if self.dp_shard != -1 and self.dp_shard % self.ep:
            self._fail("ep", f"{self.ep} does not divide parallel.dp_shard={self.dp_shard} (the "
                       "ep ranks are dp ranks of one shard group)",
                       "pick an ep that divides dp_shard (dp without HSDP)")

    @property
    def dp_shard_mod_ep(self) -> int:
        """The dp ranks each expert's weights are FSDP-sharded over: ``dp_shard / ep``."""
        return self.dp_shard // self.ep

    @property
    def hsdp(self) -> bool:
        """FSDP with replicas: the dp axis is a 2-D (dp_replicate, dp_shard) mesh."""
        return self.dp_mode == "fsdp" and self.dp_replicate > 1

    @property
    def layout(self) -> str:
        """The layout in one phrase for logs: ``pp2 dp4 tp1``, with ``(HSDP 2x2)`` when dp
        is split into replicas and ``ep2`` when experts are spread over dp ranks."""
        text = f"pp{self.pp} dp{self.dp} tp{self.tp}"
        if self.hsdp:
            text += f" (HSDP {self.dp_replicate}x{self.dp_shard})"
        return text + (f" ep{self.ep}" if self.ep > 1 else "")

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
        ``model`` (a :class:`~trainer.config.ModelConfig`) on ``global_batch_size``
        sequences of ``seq_len`` tokens per step. Batch rules need a concrete ``dp`` and are
        skipped while it is -1. Pure: no process group needed."""
        for what, n in (("model.n_heads", model.n_heads),
                        ("model.n_kv_heads (key/value heads)", model.kv_heads),
                        ("model.dim", model.dim),
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
        n_experts = getattr(model, "n_experts", 0)
        if self.ep > 1 and not n_experts:
            self._fail("ep", f"is {self.ep} but the model has no experts (model.n_experts=0)",
                       "set parallel.ep=1, or model.n_experts to a multiple of ep")
        if n_experts % self.ep:
            self._fail("ep", f"{self.ep} does not divide model.n_experts={n_experts}",
                       "choose an ep that divides the number of experts")
        if self.dp_mode == "ddp" and self.tp > 1:
            self._fail("dp_mode", f"'ddp' does not compose with tensor parallelism "
                       f"(parallel.tp={self.tp})", "use parallel.dp_mode='fsdp' or parallel.tp=1")
        if global_batch_size is None or self.dp == -1:
            return
        per_rank = self.dp * grad_accum_steps
        if global_batch_size % per_rank:
            fail_key("training.global_batch_size",
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
        if (dp // self.dp_replicate) % self.ep:
            self._fail("ep", f"{self.ep} does not divide the dp_shard degree "
                       f"{dp // self.dp_replicate} (world size {world_size} / (pp * tp * "
                       "dp_replicate))", "pick an ep that divides it, or launch more ranks")
        return dataclasses.replace(self, dp=dp, dp_shard=dp // self.dp_replicate,
                                   n_microbatches=self.num_microbatches)
