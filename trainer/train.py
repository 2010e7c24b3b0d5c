"""The training loop: build the parallel model, train, checkpoint, detect failures, resume.

Every rank runs :func:`run` with the same config. The loop per step: next batch (this dp
rank's slice of the global batch) -> forward/backward (pipelined when pp > 1, micro-batched
for gradient accumulation) -> global gradient norm and clipping -> loss guard (NaN/spike) ->
optimizer and LR step -> log, metrics -> preemption check -> ``maybe_save`` (the cadence
policy decides; the stall is only the staging copy). On start it resumes by itself from the
newest checkpoint under ``checkpoint.root`` that verifies; with none, it imports
``checkpoint.initial_load`` (a Hugging Face folder, ``trainer.hf``) and commits it as step 0.
What a checkpoint holds, the manager and what a resume settles are
:mod:`trainer.checkpointing` (as is ``check_startup``, which ``python -m trainer`` runs before
this module's :func:`run`).

With ``[fault_tolerance]`` this process is a rank of one replica group (``trainer.ft``): the
step starts with torchft's quorum (which may replace this group's state by a peer's),
reads the group's share of the data at the position the groups committed, averages
gradients and loss across the groups after backward, and keeps the step only when torchft
commits it; durable checkpoints are written by the group that holds the store's lease.

Size: the Trainer, one object whose loop, resume and exit codes share its state; model
building, data, faults, checkpointing and replica groups are modules of their own.
"""

from __future__ import annotations

import datetime
import logging
import math
import random
import time
from typing import Any

import torch
import torch.distributed as dist

from ckpt import (
    AllCheckpointsDamagedError,
    Checkpointer,
    CheckpointReader,
    CheckpointStore,
    EventBus,
    JsonlEventLog,
    LeaseHeldError,
    LeaseLostError,
    ManagerOptions,
    ReadOnlyCheckpointer,
    RNGState,
    StateMismatchError,
    Storage,
)
from ckpt.dcp import init_optimizer_state
from ckpt.ranks import Agreement
from monitoring import Metrics
from trainer.checkpointing import (
    ListState,
    ModelOptimState,
    TrainerState,
    build_cadence,
    build_manager,
    config_record,
    reconcile_config,
    replica_group_fingerprint,
    same_layout,
    state_mismatch_error,
)
from trainer.config import Config, ConfigError, config_fingerprint
from trainer.data import build_loader, split_microbatches
from trainer.determinism import apply_determinism
from trainer.distributed import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_HANG,
    EXIT_LEASE_LOST,
    EXIT_NOT_CHECKPOINTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    DistEnv,
)
from trainer.faults import HangWatchdog, LossGuard, NanInjector, Preemption, StragglerDetector
from trainer.ft import ReplicaState, WriterRole
from trainer.goodput import GoodputRecorder
from trainer.hf import carried_attachments, hf_attachments, hf_unavailable, import_hf
from trainer.mesh import build_mesh, dp_mesh
from trainer.parallelize import build_parallel_model

__all__ = ["Trainer", "TrainingStopped", "run"]

log = logging.getLogger("trainer")


class TrainingStopped(RuntimeError):
    """The loss guard gave up (too many bad steps, or policy 'stop')."""


class Trainer:
    """One rank's view of a training job. Build on every rank, then call :meth:`fit`."""

    def __init__(self, cfg: Config, env: DistEnv, *, events: EventBus | None = None,
                 preemption: Preemption | None = None):
        self.env = env
        ft = cfg.fault_tolerance
        # Replica groups: this process's torchrun job is one of dp_replicate groups.
        self.num_groups = cfg.parallel.dp_replicate if ft.enabled else 1
        self.cfg = cfg = cfg.resolved(env.world_size * self.num_groups)
        self.fingerprint = config_fingerprint(cfg)
        self.config_record = config_record(cfg)
        self.loaded_fingerprint: str | None = None
        p, t = cfg.parallel, cfg.training
        # Resolved and checked against the model and batch by cfg.resolved; with replica
        # groups, this group's part of it (the replicate axis is torchft's).
        self.par = ft.group_layout(p) if ft.enabled else p
        self.model_cfg = cfg.model
        # Deterministic kernels (python -m trainer set them before CUDA started already).
        apply_determinism(t.deterministic)
        # Every random stream a rank may use starts from the config's seed, so two runs of
        # one config are the same run (and a resumed one restores the streams it saved).
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        self.mesh = None
        if env.distributed:
            self.mesh = build_mesh(self.par, env.device.type)
        self.model = build_parallel_model(
            self.model_cfg, self.par, self.mesh, t.seed, env.device,
            param_dtype=torch.bfloat16 if t.mixed_precision == "bf16" else torch.float32,
            recomputed_layers=t.recomputed_layers(self.model_cfg.n_layers))
        self.optimizers = [torch.optim.AdamW(part.parameters(), lr=t.lr, betas=tuple(t.betas),
                                             eps=t.eps, weight_decay=t.weight_decay)
                           for part in self.model.model_parts]
        for o in self.optimizers:
            init_optimizer_state(o)
        # The schedule the LR follows: this config's, or the checkpoint's on a resume that
        # does not override it (_reconcile_config).
        self.lr_schedule = t
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: self.lr_schedule.lr_at(s) / self.lr_schedule.lr)
            for o in self.optimizers]
        # The whole dp rank (under HSDP replicate and shard ranks both): each its own slice.
        # A replica group's loader reads group batches (global batch / groups), the one at
        # index batches_committed + replica rank (see fit).
        dp_rank = dp_mesh(self.mesh).get_local_rank() if self.mesh is not None else 0
        self.loader = build_loader(cfg, dp_rank, self.par.dp,
                                   t.global_batch_size // self.num_groups)
        self.step = 0
        self.num_skipped_steps = 0
        self.guard = LossGuard(cfg.fault.spike_factor, cfg.fault.spike_window)
        self.stragglers = StragglerDetector(cfg.fault.straggler_factor)
        self.nan_injector = NanInjector(cfg.fault.inject_nan_step)
        # python -m trainer's, installed before the process group (run's docstring says).
        self.preemption = preemption or Preemption(cfg.fault.preemption_grace_seconds)
        self.events = events or EventBus(rank=env.rank)
        # The newest durable commit's {"step", "seconds"} (its whole time, as a blocking save
        # takes it): each save's metadata carries it, for the grace check of the next start.
        self.last_save: dict[str, Any] | None = None
        self.events.subscribe(self._note_save)
        # The same timeout as the training group's: after the hang watchdog (Config says).
        self.ctl_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(
            seconds=cfg.process_group_timeout_seconds())) if env.distributed else None
        self.losses: list[tuple[int, float]] = []
        self.metrics = None
        if cfg.metrics.port:  # every rank, on base port + LOCAL_RANK (docs/monitoring.md)
            m, hang = cfg.metrics, cfg.fault.hang_timeout_seconds
            self.metrics = Metrics(self.events, rank=env.rank, stall_factor=m.stall_factor,
                                   stall_min_seconds=m.stall_min_seconds,
                                   stall_max_seconds=hang / 2 if hang > 0 else math.inf,
                                   startup_seconds=m.startup_seconds,
                                   age_slack_seconds=m.age_slack_seconds, device=env.device)
            port = self.metrics.serve(m.port + env.local_rank, m.host)
            log.info("rank %d metrics on http://%s:%d/metrics", env.rank, m.host, port)
        if cfg.metrics.jsonl_path and env.rank == 0:
            self.events.subscribe(JsonlEventLog(cfg.metrics.jsonl_path))
        self.replicas = None  # trainer.ft.replicas.ReplicaGroup, built by fit()
        self.writer: WriterRole | None = None
        self.final_committed = True  # False: a standby group saw no final checkpoint
        if ft.enabled and cfg.checkpoint.enabled:
            # Built when this group takes the store's lease (trainer.ft.writer).
            self.manager: Checkpointer | None = None
            self.writer = WriterRole(
                Storage(cfg.checkpoint.root, cfg.checkpoint.storage_options or None),
                lambda: build_manager(cfg, env.world_size, self.events, self.fingerprint,
                                      self.par),
                agreement=Agreement(self.ctl_group), coordinator=env.rank == 0,
                events=self.events, group_id=ft.group_id, ttl_seconds=ft.lease_ttl_seconds,
                retry_steps=ft.lease_retry_steps,
                fingerprint=replica_group_fingerprint(self.fingerprint, ft.group_id))
        else:
            try:
                self.manager = (build_manager(cfg, env.world_size, self.events, self.fingerprint)
                                if cfg.checkpoint.enabled else None)
            except LeaseHeldError:
                # Another job holds the root: for the alerts, as a lost lease (seen by a scrape
                # before the exit, and newer than this start: CheckpointLeaseLost keeps firing).
                self.events.emit("lease_lost", None, reason="held by another job at start")
                self._end_metrics(EXIT_LEASE_LOST)
                raise
        # Where the job's wall time went, continued from the root's history (trainer/goodput).
        self.goodput = GoodputRecorder(
            self.events, coordinator=env.rank == 0, manager=self.manager,
            storage=self.writer.storage if self.writer is not None else None)
        if self.metrics is not None:
            self.metrics.observe_goodput(self.goodput.ledger)
        # Every save carries config.json and the weights' Llama (Mixtral) names
        # (trainer/hf.py), so `ckpt export --format hf` writes a folder from_pretrained loads.
        self.hf_files = hf_attachments(self.model_cfg)
        unavailable = hf_unavailable(self.model_cfg)
        if self.manager is not None and unavailable is not None and env.rank == 0:
            log.info("the model has no Hugging Face architecture, so checkpoints carry no "
                     "config.json and `ckpt export --format hf` refuses them: %s", unavailable)
        if self.metrics is not None and self.manager is not None:
            self.metrics.observe_store(self.manager.store)  # checkpoint age across restarts
            if self.manager.cadence is not None:
                self.events.emit("cadence", None, **self.manager.cadence.describe())
        elif self.metrics is not None and self.writer is not None:
            # A replica group that does not write exports the store's newest commit and the
            # cadence too: the checkpoint-age alert reads every group alike.
            self.metrics.observe_store(CheckpointStore(self.writer.storage))
            self.events.emit("cadence", None, **build_cadence(cfg).describe())

    # -- checkpointing -----------------------------------------------------------------------
    def _metadata(self, loss: float | None) -> dict[str, Any]:
        """A save's user metadata: the step's loss (``ckpt list`` shows it), the config,
        what the newest save before it took (``last_save``) and the job's productive
        training seconds so far (a resume from it knows what it keeps: trainer/goodput.py)."""
        return {"loss": loss, "config": self.config_record, "last_save": self.last_save,
                "productive_seconds": self.goodput.productive_seconds()}

    def _note_save(self, event) -> None:
        """A durable commit: remember its time, and check it against the preemption grace."""
        if event.kind == "save_committed" and isinstance(
                event.fields.get("total_seconds"), (int, float)):
            self.last_save = {"step": event.step, "seconds": event.fields["total_seconds"]}
            if self.env.rank == 0:
                self.preemption.check_save_seconds(self.last_save["seconds"], event.step)

    def checkpoint_state(self, with_rng: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = {
            "app": ModelOptimState(self.model, self.optimizers),
            "sched": ListState(self.schedulers),
            "data": self.loader,
            "trainer": TrainerState(self),
        }
        if with_rng:
            state["rng"] = RNGState(self.env.rank)
        return state

    def resume(self) -> int | None:
        """Load the newest valid checkpoint (or ``checkpoint.load_step``); None if none.

        A replica group that does not write checkpoints reads them all the same (without a
        manager, and changing nothing under the root): every group starts from the store,
        then the quorum brings a group that is behind a live peer up to it."""
        c = self.cfg.checkpoint
        if not c.enabled or not c.resume:
            return self._import_initial() if c.initial_load else None
        reader = self.manager if self.manager is not None else self._standby_reader()
        try:
            manifest = reader.load_latest(self.checkpoint_state(with_rng=False),
                                          step=c.load_step, ignore_keys=("rng.",),
                                          raise_if_all_damaged=True,
                                          extra_state=self._rng_if_same_layout)
        except StateMismatchError as exc:
            raise state_mismatch_error(exc, c.root) from None
        except AllCheckpointsDamagedError as exc:
            fix = "--checkpoint.allow_fresh_start_over_damaged=true"
            if not c.allow_fresh_start_over_damaged:
                raise AllCheckpointsDamagedError(
                    exc.root, exc.failures,
                    fix=f"Refusing to start over from step 0; to do that on purpose, pass {fix}."
                ) from None
            # The failed loads left the state untouched: this is a true fresh start, a new
            # trajectory. It is recorded first (what it goes back past is abandoned, even
            # what cannot be un-committed: ``ckpt.root.lineage``), then the damaged steps are
            # un-committed so that this run can save those steps again.
            if self.env.rank == 0:
                log.warning("%s", AllCheckpointsDamagedError(
                    exc.root, exc.failures, fix="Starting from step 0 on purpose "
                    "(checkpoint.allow_fresh_start_over_damaged is set)" + (
                        f", imported from checkpoint.initial_load ({c.initial_load}) again."
                        if c.initial_load else ".")))
            if self.manager is not None:  # a standby replica group changes nothing
                self.manager.start_run(None)  # every rank, as below
                self.manager.uncommit_newer(-1)  # every rank: rank 0 acts, all wait
            # A fine-tuning job's step 0 is the imported folder, never a random init.
            return self._import_initial() if c.initial_load else None
        if manifest is None:
            if c.initial_load:
                return self._import_initial()
            log.info("no checkpoint under %s: starting fresh", c.root) if self.env.rank == 0 \
                else None
            return None
        self._carry_attachments(manifest, reader)
        same = self._same_layout(manifest)
        if self.loaded_fingerprint and self.loaded_fingerprint != self.fingerprint:
            log.warning("checkpoint step %d was written with a different model/data/optimizer "
                        "config (fingerprint %s, now %s): the run will not continue bit for bit",
                        manifest.step, self.loaded_fingerprint, self.fingerprint)
        self._reconcile_config(manifest)
        if self.env.rank == 0:
            last = (manifest.user_metadata or {}).get("last_save")
            if isinstance(last, dict):  # what a save took before this start
                self.preemption.check_save_seconds(last.get("seconds"), last.get("step"))
            resumed = reader.resumed
            log.info("resumed from %s step %d%s%s", c.root if resumed.tier != "local" else
                     f"the local tier ({resumed.where})", manifest.step,
                     "" if same else f" (saved on layout {manifest.layout}, resharded)",
                     f"; checkpoint.initial_load ({c.initial_load}) is not read: a resume "
                     f"wins" if c.initial_load else "")
        self.events.emit("resumed", manifest.step, same_layout=same, productive_seconds=(
            manifest.user_metadata or {}).get("productive_seconds"))
        return manifest.step

    def _import_initial(self) -> int:
        """``checkpoint.initial_load``: the Hugging Face folder's weights, each rank reading
        its own shards (:func:`trainer.hf.import_hf`), committed at once as step 0 with the
        folder's tokenizer and generation files, so that a restart resumes from root and
        never reads the folder again. Every rank; returns 0, the step training starts from."""
        c = self.cfg.checkpoint
        report, extra = import_hf(c.initial_load, self.model_cfg, self.model,
                                  storage_options=c.storage_options or None,
                                  process_group=self.ctl_group)
        self.hf_files = {**extra, **(self.hf_files or {})}
        if self.env.rank == 0:
            log.info("imported %s (%d tensors, %.1f MiB read by rank 0 in %.1fs%s); "
                     "committing it as step 0", c.initial_load, len(report.loaded),
                     report.bytes_read / 2**20, report.seconds,
                     f", attaching {', '.join(sorted(extra))}" if extra else "")
        if self.manager is not None:
            self._forced_save(None)
        return 0

    def _carry_attachments(self, manifest, reader: CheckpointReader) -> None:
        """The resumed version's attachments this run does not make itself (an import's
        tokenizer files) go on with every save; one that cannot be read is left out, and
        the log says so."""
        resumed = reader.resumed
        storage = Storage(resumed.where) if resumed.tier == "local" else reader.storage
        try:
            carried = carried_attachments(storage, manifest, self.hf_files or {})
        except (OSError, ValueError) as exc:
            log.warning("checkpoint step %d: its attachments are not carried to the next "
                        "saves: %s", manifest.step, exc)
            return
        if carried:
            self.hf_files = {**carried, **(self.hf_files or {})}

    def _same_layout(self, manifest) -> bool:
        return same_layout(manifest, self.par, self.env.world_size)

    def _rng_if_same_layout(self, manifest) -> dict[str, Any]:
        """RNG streams resume only on the same layout (another layout draws differently);
        loaded in the same transaction as the rest, so a damaged RNG item falls back."""
        return {"rng": RNGState(self.env.rank)} if self._same_layout(manifest) else {}

    def _reconcile_config(self, manifest) -> None:
        """Right after a resume, on every rank: which LR schedule continues (see
        :func:`trainer.checkpointing.reconcile_config`, which also logs the config changes)."""
        schedule = reconcile_config(manifest, self.cfg.training, self.config_record,
                                    self.optimizers, self.schedulers, self.env.rank)
        if schedule is not None:
            self.lr_schedule = schedule

    def _standby_reader(self) -> ReadOnlyCheckpointer:
        """What a replica group that holds no lease resumes with: the root, read only, once
        another group's takeover settled (or its wait ran out)."""
        c = self.cfg.checkpoint
        if self.writer is not None and not self.writer.wait_settled(
                self.cfg.fault_tolerance.lease_ttl_seconds + 30):
            log.warning("another replica group is still taking over %s; reading it anyway",
                        c.root) if self.env.rank == 0 else None
        return ReadOnlyCheckpointer(self.writer.storage if self.writer is not None else c.root,
                                    ManagerOptions(verify=c.verify),
                                    process_group=self.ctl_group)

    # -- the loop ------------------------------------------------------------------------------
    def _agree_any(self, flag: bool) -> bool:
        return Agreement(self.ctl_group).any(flag) if self.ctl_group is not None else flag

    def train_step(self) -> tuple[float, float]:
        t = self.cfg.training
        inputs, targets = self.loader.next_batch()
        chunks = split_microbatches(inputs, targets, t.grad_accum_steps)
        loss = 0.0
        for i, (x, y) in enumerate(chunks):
            loss += self.model.forward_backward(
                x, y, num_accum_steps=len(chunks), sync_grads=(i == len(chunks) - 1))
        loss /= len(chunks)
        if self.replicas is not None:
            loss = self._average_across_groups(loss)
        grad_norm = self.model.clip_grad_norm_(t.grad_clip if t.grad_clip > 0 else math.inf)
        if self.cfg.fault.inject_step_delay_seconds:
            time.sleep(self.cfg.fault.inject_step_delay_seconds)
        return loss, grad_norm

    # -- replica groups (fault_tolerance) --------------------------------------------------------
    def _average_across_groups(self, loss: float) -> float:
        """Average this rank's gradients (its local shards: rank k of every group holds the
        same ones) and the loss over the quorum's replica groups, one flat buffer per dtype.
        If a peer fails meanwhile the gradients are garbage, and the step does not commit."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.model.parameters():
            if p.grad is None:  # every group must send the same buffer layout
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            by_dtype.setdefault(g.dtype, []).append(g)
        flats = [torch.cat([g.reshape(-1) for g in grads]) for grads in by_dtype.values()]
        loss_t = torch.tensor([loss], dtype=torch.float64, device=flats[0].device
                              if flats else None)
        if not self.replicas.average([*flats, loss_t]):
            return loss
        for grads, flat in zip(by_dtype.values(), flats):
            for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(reduced.view_as(g))
        return float(loss_t)

    def _join_replicas(self) -> None:
        """Build this rank's :class:`trainer.ft.replicas.ReplicaGroup` after the resume (so the
        group joins a quorum only when it can train), at the step and data position the
        resume restored."""
        from trainer.ft.replicas import ReplicaGroup  # torchft: the optional 'ft' extra

        ft = self.cfg.fault_tolerance
        state = ReplicaState(self.model, self.optimizers, self.schedulers, TrainerState(self))
        self.replicas = ReplicaGroup(self.cfg, state, rank=self.env.rank,
                                     world_size=self.env.world_size, device=self.env.device,
                                     agreement=Agreement(self.ctl_group), events=self.events)
        self.replicas.restore_counters(self.step, self.loader.global_batch_index)
        self.events.emit("ft_started", self.step, group_id=ft.group_id,
                         replica_groups=self.num_groups, min_replicas=ft.min_replicas,
                         alert_min_quorum=ft.alert_min_quorum or self.num_groups,
                         lighthouse=ft.lighthouse)
        log.info("replica group %d of %d: joining the quorum at %s from step %d",
                 ft.group_id, self.num_groups, ft.lighthouse, self.step) \
            if self.env.rank == 0 else None

    def _writer_step(self, now: bool = False) -> None:
        """A standby group's try for the lease, at agreed steps (``trainer.ft.writer``)."""
        if self.writer is None or self.manager is not None:
            return
        if self.writer.try_acquire(self.step, now=now):
            self.manager = self.writer.manager
            self.goodput.attach(self.manager)
            if self.metrics is not None:
                self.metrics.observe_store(self.manager.store)
                if self.manager.cadence is not None:
                    self.events.emit("cadence", self.step, **self.manager.cadence.describe())

    def _replica_digests(self) -> None:
        """Emit this rank's replica digests (equal on rank k of every group that is a
        bit-identical replica; checked by the tests and scripts/ft_demo.sh)."""
        state = ReplicaState(self.model, self.optimizers, self.schedulers, TrainerState(self))
        d = state.digests()
        log.info("replica group %d rank %d at step %d: replica digest %s",
                 self.cfg.fault_tolerance.group_id, self.env.rank, self.step,
                 " ".join(f"{k}={v}" for k, v in d.items()))
        self.events.emit("ft_replica_digest", self.step, model=d["model"], optim=d["optim"],
                         rng=d["rng"], trainer=d["trainer"])

    def _handle_bad_step(self, verdict: str, loss: float) -> None:
        f = self.cfg.fault
        self.events.emit("failure", self.step, failure=verdict, loss=loss)
        log.warning("step %d: %s loss %.4g (policy %s)", self.step, verdict, loss, f.nan_policy)
        self.num_skipped_steps += 1
        if f.nan_policy == "stop" or self.num_skipped_steps > f.max_skips:
            raise TrainingStopped(f"step {self.step}: {verdict} loss {loss!r}; stopping "
                                  f"(fault.nan_policy={f.nan_policy}, {self.num_skipped_steps} "
                                  f"bad steps, fault.max_skips={f.max_skips})")
        if f.nan_policy == "rollback" and self.manager is not None:
            bad_batch = self.loader.global_batch_index - 1
            # Loading restores the checkpoint's count; keep counting the bad steps of this
            # run, or a loss that is bad after every rollback would roll back forever.
            skipped = self.num_skipped_steps
            self.manager.wait(raise_errors=False)
            manifest = self.manager.load_latest(self.checkpoint_state(with_rng=False),
                                                ignore_keys=("rng.",))
            if manifest is not None:
                consumed = (bad_batch + 1) * self.loader.global_batch_size
                st = self.loader.state_dict()
                st.update(next_batch=bad_batch + 1, samples_consumed=consumed)
                self.loader.load_state_dict(st)  # continue past the bad batch
                self.num_skipped_steps = skipped
                log.warning("rolled back to step %d; continuing after the bad batch %d",
                            manifest.step, bad_batch)

    def fit(self) -> int:
        cfg, t = self.cfg, self.cfg.training
        watchdog = HangWatchdog(cfg.fault.hang_timeout_seconds, exit_code=EXIT_HANG,
                                linger_seconds=cfg.metrics.linger_seconds if self.metrics else 0,
                                on_grace=self.metrics.allow_grace if self.metrics else None,
                                on_hang=lambda idle: self.events.emit("failure", self.step,
                                                                      failure="hang"))
        if cfg.fault.handle_preemption:
            self.preemption.install()
        if self.writer is not None:  # every replica group tries; the holder resumes as writer
            self._writer_step(now=True)
        start_step = self.resume()
        if self.metrics is not None and self.manager is not None:
            self.metrics.observe_store(self.manager.store)  # after a fallback's un-commits
        if self.env.rank == 0 and start_step is None:
            moe = (f", {self.model_cfg.num_params(active=True)} active"
                   if self.model_cfg.n_experts else "")
            log.info("starting at step 0 (%d parameters%s, layout %s, %s)",
                     self.model_cfg.num_params(), moe, self.par.layout, self.env.device)
        if self.manager is not None:
            self.manager.prepare(self.checkpoint_state())
        if cfg.fault_tolerance.enabled:
            self._join_replicas()
        watchdog.grace_seconds = 120.0  # first steps include warm-up
        watchdog.start()
        self.goodput.start()
        group_tokens = t.global_batch_size // self.num_groups * t.seq_len
        quorum = self.num_groups
        exit_code = EXIT_OK
        crashed = True
        stopped = False  # left before the last step (preempted, lease lost)
        try:
            while self.step < t.steps:
                t0 = time.perf_counter()
                if self.replicas is not None:
                    # Waiting for a quorum (a hung peer, a heal) is not a hang of this
                    # group; quorum_timeout_seconds bounds it.
                    watchdog.grace_seconds = (cfg.quorum_timeout_seconds()
                                              + 2 * cfg.fault_tolerance.timeout_seconds)
                    info = self.replicas.start_step()
                    watchdog.progress()
                    self.step, quorum = info.step, info.quorum_size  # a heal moves the step
                    if self.step >= t.steps:
                        break
                    self.loader.seek(info.batch_index)
                    rng = RNGState(self.env.rank).state_dict()
                loss, grad_norm = self.train_step()
                if self.replicas is not None and not self.replicas.commit():
                    # Nothing of this step is kept: no update, no data consumed (the next
                    # quorum reads the same batches), the random streams as they were.
                    RNGState(self.env.rank).load_state_dict(rng)
                    for o in self.optimizers:
                        o.zero_grad(set_to_none=True)
                    watchdog.progress()
                    continue
                loss = self.nan_injector.apply(self.step + 1, loss)
                verdict = self.guard.check(loss, grad_norm)
                if verdict is None:
                    for o in self.optimizers:
                        o.step()
                    self.num_skipped_steps = 0
                for o in self.optimizers:
                    o.zero_grad(set_to_none=True)
                if verdict is None:
                    for s in self.schedulers:
                        s.step()
                if self.replicas is not None:
                    self.step = self.replicas.step
                    self.loader.seek(self.replicas.batches_committed)
                else:
                    self.step += 1
                dt = time.perf_counter() - t0
                tokens_per_step = quorum * group_tokens
                self.losses.append((self.step, loss))
                comm_bytes, comm_seconds = self.model.comm.take()
                router = {str(layer): {"imbalance": s.imbalance, "aux_loss": s.aux_loss}
                          for layer, s in self.model.take_router_stats().items()}
                self.events.emit("train_step", self.step, loss=loss, grad_norm=grad_norm,
                                 step_seconds=dt, tokens_per_second=tokens_per_step / dt,
                                 lr=self.schedulers[0].get_last_lr()[0],
                                 comm_bytes=comm_bytes, comm_seconds=comm_seconds,
                                 router=router or None)
                if self.env.rank == 0 and (self.step % t.log_every == 0 or self.step == 1
                                           or self.step == t.steps):
                    log.info("step %5d | loss %.4f | grad norm %.3f | %.0f tok/s | %.3fs/step%s",
                             self.step, loss, grad_norm, tokens_per_step / dt, dt,
                             f" | quorum {quorum}/{self.num_groups}" if self.replicas else "")
                if verdict is not None:
                    # After the step is logged: a rollback moves self.step back.
                    self._handle_bad_step(verdict, loss)
                if self.step % max(1, t.log_every) == 0:
                    self._check_stragglers(dt)
                watchdog.progress()
                if self._agree_any(self.preemption.received is not None):
                    log.warning("preemption signal: saving step %d and exiting", self.step)
                    self.events.emit("failure", self.step, failure="preempted")
                    self._leave_replicas()  # the other groups need not wait for this one
                    if self.manager is not None:
                        watchdog.grace_seconds = cfg.fault.blocking_save_grace_seconds
                        self._forced_save(loss)
                    exit_code, stopped = EXIT_PREEMPTED, True
                    break
                self._writer_step()
                if self.manager is not None and self.step < t.steps:
                    self.manager.maybe_save(self.step, self.checkpoint_state(),
                                            user_metadata=self._metadata(loss),
                                            attachments=self.hf_files)
                    if self.manager.lease_lost:  # agreed by every rank at the save
                        if self.writer is not None:  # another replica group writes now
                            self.writer.check_lost(self.step)
                            self.manager = None
                            continue
                        exit_code, stopped = EXIT_LEASE_LOST, True
                        break
            if not stopped:
                self._finish(watchdog)
                if self.manager is not None:  # every rank: the last commit may have found
                    self.manager.check_lease()  # the lease taken (the exit code says so)
            crashed = False
        finally:
            watchdog.stop()
            self.preemption.uninstall()
            self._leave_replicas()
            self.goodput.stop(ended=not crashed and not stopped)  # before the last history write
            if self.manager is not None:
                self.manager.close(flush=True)
            if crashed and self.metrics is not None:
                self.metrics.shutdown()
        exit_code = self._checked_exit(exit_code)
        self._end_metrics(exit_code)
        return exit_code

    def _end_metrics(self, exit_code: int) -> None:
        """Say how the run ended (``run_ended``) and stop serving metrics. A finished run
        and a lost lease keep serving ``metrics.linger_seconds`` first, so that a scrape
        sees them: the alerts tell a finished job from a dead one (TrainingJobDown) and
        keep a lost lease firing after the exit (CheckpointLeaseLost) by what they saw."""
        self.events.emit("run_ended", self.step, exit_code=exit_code)
        if self.metrics is not None:
            self.metrics.shutdown(linger_seconds=self.cfg.metrics.linger_seconds if exit_code
                                  in (EXIT_OK, EXIT_LEASE_LOST) else 0.0)

    def _forced_save(self, loss: float | None, manager: Checkpointer | None = None) -> None:
        """Save this step now, blocking (preemption, the last step), with ``manager`` (default
        this rank's). A save that cannot happen (the write lease lost, the step committed by
        an earlier run or another replica group) is logged, and :meth:`_checked_exit` turns
        it into the exit code."""
        try:
            (manager or self.manager).save(self.step, self.checkpoint_state(), force=True,
                                           block=True, user_metadata=self._metadata(loss),
                                           attachments=self.hf_files)
        except LeaseLostError:
            pass  # logged by the manager; the exit code says it
        except FileExistsError as exc:
            if self.env.rank == 0:
                log.error("%s", exc)

    def _finish(self, watchdog: HangWatchdog) -> None:
        """After the last step: the final checkpoint (always saved, so a finished run can be
        exported). A replica group that does not write waits for the writer's, or takes the
        lease and writes it when the writer is gone."""
        loss = self.losses[-1][1] if self.losses else None
        if self.replicas is not None:
            self._replica_digests()
            self._leave_replicas()
        # A blocking save is slow, not hung: the watchdog gives it time.
        watchdog.grace_seconds = self.cfg.fault.blocking_save_grace_seconds
        if self.manager is not None:
            self._forced_save(loss)
        elif self.writer is not None:
            ft = self.cfg.fault_tolerance
            self.final_committed = self.writer.finish(
                self.step, lambda m: self._forced_save(loss, m),
                timeout_seconds=2 * ft.lease_ttl_seconds + 60)
            self.manager = self.writer.manager

    def _leave_replicas(self) -> None:
        if self.replicas is not None:
            self.replicas.leave()
            self.replicas = None

    def _checked_exit(self, exit_code: int) -> int:
        """Exit 0 only when the last step is committed; otherwise a code and one line why."""
        m = self.manager
        if m is None:
            if exit_code == EXIT_OK and not self.final_committed:
                log.error("trained to step %d but no replica group committed its checkpoint "
                          "(exit %d). Restart to resume from the newest checkpoint.",
                          self.step, EXIT_NOT_CHECKPOINTED)
                return EXIT_NOT_CHECKPOINTED
            return exit_code
        if exit_code == EXIT_LEASE_LOST or (exit_code == EXIT_OK and m.lease_lost):
            url = m.lease_lost_url or m.storage.url
            log.error("stopped at step %d: another job took over the write lease on %s; this "
                      "job's saves no longer count (exit %d). Check which job should own "
                      "the root (`ckpt list %s --all`).", self.step, url,
                      EXIT_LEASE_LOST, url)
            return EXIT_LEASE_LOST
        if exit_code == EXIT_OK and m.newest_committed_step != self.step:
            log.error("trained to step %d but its checkpoint did not commit (newest committed "
                      "by this run: %s; storage failures are logged above) (exit %d). "
                      "Restart to resume from the newest checkpoint.", self.step,
                      m.newest_committed_step, EXIT_NOT_CHECKPOINTED)
            return EXIT_NOT_CHECKPOINTED
        return exit_code

    def _check_stragglers(self, dt: float) -> None:
        if self.ctl_group is None or self.cfg.fault.straggler_factor <= 0:
            return
        mine = torch.tensor([dt], dtype=torch.float64)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine, group=self.ctl_group)
        times = [float(g) for g in gathered]
        slow = self.stragglers.find(times)
        if slow and self.env.rank == 0:
            log.warning("step %d: straggler rank(s) %s (step times %s)", self.step, slow,
                        ", ".join(f"{x:.3f}s" for x in times))
            for r in slow:
                self.events.emit("failure", self.step, failure="straggler", slow_rank=r)


def run(cfg: Config, env: DistEnv, preemption: Preemption | None = None) -> int:
    """Train per ``cfg``; returns the process exit code (see trainer.distributed).
    ``preemption``: handles the preemption signals already (a signal received before the
    loop starts is answered at its first step boundary)."""
    try:
        trainer = Trainer(cfg, env, preemption=preemption)
        return trainer.fit()
    except (ConfigError, ValueError) as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    except TrainingStopped as exc:
        log.error("%s", exc)
        return EXIT_FAILED
    except LeaseHeldError as exc:
        log.error("%s", exc)
        return EXIT_LEASE_LOST
