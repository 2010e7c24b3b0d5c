"""The training loop: build the parallel model, train, checkpoint, detect failures, resume.

Every rank runs :func:`run` with the same config. The loop per step: next batch (this dp
rank's slice of the global batch) -> forward/backward (pipelined when pp > 1, micro-batched
for gradient accumulation) -> global gradient norm and clipping -> loss guard (NaN/spike) ->
optimizer and LR step -> log, metrics -> preemption check -> ``maybe_save`` (the cadence
policy decides; the stall is only the staging copy). On start it resumes by itself from the
newest checkpoint under ``checkpoint.root`` that verifies. What a checkpoint holds, the
manager and what a resume settles are :mod:`trainer.checkpointing` (as is ``check_startup``,
which ``python -m trainer`` runs before this module's :func:`run`).
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

from ckpt.dcp import RNGState, init_optimizer_state
from ckpt.errors import AllCheckpointsDamagedError, LeaseHeldError, LeaseLostError
from ckpt.events import EventBus, JsonlEventLog
from ckpt.ranks import Agreement
from monitoring import Metrics
from trainer.checkpointing import (
    ListState,
    ModelOptimState,
    TrainerState,
    build_manager,
    config_record,
    reconcile_config,
    same_layout,
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
from trainer.hf import hf_attachments
from trainer.mesh import build_mesh, dp_mesh
from trainer.parallelize import build_parallel_model

__all__ = ["Trainer", "TrainingStopped", "run"]

log = logging.getLogger("trainer")


class TrainingStopped(RuntimeError):
    """The loss guard gave up (too many bad steps, or policy 'stop')."""


class Trainer:
    """One rank's view of a training job. Build on every rank, then call :meth:`fit`."""

    def __init__(self, cfg: Config, env: DistEnv, *, events: EventBus | None = None):
        self.env = env
        self.cfg = cfg = cfg.resolved(env.world_size)
        self.fingerprint = config_fingerprint(cfg)
        self.config_record = config_record(cfg)
        self.loaded_fingerprint: str | None = None
        p, t = cfg.parallel, cfg.training
        self.par = p  # resolved and checked against the model and batch by cfg.resolved
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
            param_dtype=torch.bfloat16 if t.mixed_precision == "bf16" else torch.float32)
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
        dp_rank = dp_mesh(self.mesh).get_local_rank() if self.mesh is not None else 0
        self.loader = build_loader(cfg, dp_rank, p.dp)
        self.step = 0
        self.num_skipped_steps = 0
        self.guard = LossGuard(cfg.fault.spike_factor, cfg.fault.spike_window)
        self.stragglers = StragglerDetector(cfg.fault.straggler_factor)
        self.nan_injector = NanInjector(cfg.fault.inject_nan_step)
        self.preemption = Preemption()
        self.events = events or EventBus(rank=env.rank)
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
                                   age_slack_seconds=m.age_slack_seconds)
            port = self.metrics.serve(m.port + env.local_rank, m.host)
            log.info("rank %d metrics on http://%s:%d/metrics", env.rank, m.host, port)
        if cfg.metrics.jsonl_path and env.rank == 0:
            self.events.subscribe(JsonlEventLog(cfg.metrics.jsonl_path))
        try:
            self.manager = (build_manager(cfg, env.world_size, self.events, self.fingerprint)
                            if cfg.checkpoint.enabled else None)
        except LeaseHeldError:
            # Another job holds the root: for the alerts, as a lost lease (seen by a scrape
            # before the exit, and newer than this start: CheckpointLeaseLost keeps firing).
            self.events.emit("lease_lost", None, reason="held by another job at start")
            self._end_metrics(EXIT_LEASE_LOST)
            raise
        # Every save carries config.json and the weights' Llama names (trainer/hf.py), so
        # `ckpt export --format hf` writes a folder from_pretrained loads.
        self.hf_files = hf_attachments(self.model_cfg) or None
        if self.manager is not None and self.hf_files is None and env.rank == 0:
            log.info("model.activation=%r has no Hugging Face architecture (a SwiGLU model is "
                     "a LlamaForCausalLM): checkpoints carry no config.json, and `ckpt export "
                     "--format hf` needs --no-config", self.model_cfg.activation)
        if self.metrics is not None and self.manager is not None:
            self.metrics.observe_store(self.manager.store)  # checkpoint age across restarts
            if self.manager.cadence is not None:
                self.events.emit("cadence", None, **self.manager.cadence.describe())

    # -- checkpointing -----------------------------------------------------------------------
    def _metadata(self, loss: float | None) -> dict[str, Any]:
        """A save's user metadata: the step's loss (``ckpt list`` shows it) and the config."""
        return {"loss": loss, "config": self.config_record}

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
        """Load the newest valid checkpoint (or ``checkpoint.load_step``); None if none."""
        if self.manager is None or not self.cfg.checkpoint.resume:
            return None
        c = self.cfg.checkpoint
        try:
            manifest = self.manager.load_latest(self.checkpoint_state(with_rng=False),
                                                step=c.load_step, ignore_keys=("rng.",),
                                                raise_if_all_damaged=True,
                                                extra_state=self._rng_if_same_layout)
        except AllCheckpointsDamagedError as exc:
            fix = "--checkpoint.allow_fresh_start_over_damaged=true"
            if not c.allow_fresh_start_over_damaged:
                raise AllCheckpointsDamagedError(
                    exc.root, exc.failures,
                    fix=f"Refusing to start over from step 0; to do that on purpose, pass {fix}."
                ) from None
            # The failed loads left the state untouched: this is a true fresh start. The
            # damaged steps are un-committed so that this run can save those steps again.
            if self.env.rank == 0:
                log.warning("%s", AllCheckpointsDamagedError(
                    exc.root, exc.failures, fix="Starting from step 0 on purpose "
                    "(checkpoint.allow_fresh_start_over_damaged is set)."))
            self.manager.uncommit_newer(-1)  # every rank: rank 0 acts, all wait
            return None
        if manifest is None:
            log.info("no checkpoint under %s: starting fresh", c.root) if self.env.rank == 0 \
                else None
            return None
        same = self._same_layout(manifest)
        if self.loaded_fingerprint and self.loaded_fingerprint != self.fingerprint:
            log.warning("checkpoint step %d was written with a different model/data/optimizer "
                        "config (fingerprint %s, now %s): the run will not continue bit for bit",
                        manifest.step, self.loaded_fingerprint, self.fingerprint)
        self._reconcile_config(manifest)
        if self.env.rank == 0:
            tier = self.manager.resumed_tier
            log.info("resumed from %s step %d%s", c.root if tier != "local" else
                     f"the local tier ({self.manager.local_root})", manifest.step,
                     "" if same else f" (saved on layout {manifest.layout}, resharded)")
        self.events.emit("resumed", manifest.step, same_layout=same)
        return manifest.step

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
        grad_norm = self.model.clip_grad_norm_(t.grad_clip if t.grad_clip > 0 else math.inf)
        return loss, grad_norm

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
        start_step = self.resume()
        if self.metrics is not None and self.manager is not None:
            self.metrics.observe_store(self.manager.store)  # after a fallback's un-commits
        if self.env.rank == 0 and start_step is None:
            log.info("starting at step 0 (%d parameters, layout pp%d dp%d tp%d, %s)",
                     self.model_cfg.num_params(), self.par.pp, self.par.dp, self.par.tp,
                     self.env.device)
        if self.manager is not None:
            self.manager.prepare(self.checkpoint_state())
        watchdog.grace_seconds = 120.0  # first steps include warm-up
        watchdog.start()
        tokens_per_step = t.global_batch_size * t.seq_len
        exit_code = EXIT_OK
        crashed = True
        try:
            while self.step < t.steps:
                t0 = time.perf_counter()
                loss, grad_norm = self.train_step()
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
                self.step += 1
                dt = time.perf_counter() - t0
                self.losses.append((self.step, loss))
                self.events.emit("train_step", self.step, loss=loss, grad_norm=grad_norm,
                                 step_seconds=dt, tokens_per_second=tokens_per_step / dt,
                                 lr=self.schedulers[0].get_last_lr()[0])
                if self.env.rank == 0 and (self.step % t.log_every == 0 or self.step == 1
                                           or self.step == t.steps):
                    log.info("step %5d | loss %.4f | grad norm %.3f | %.0f tok/s | %.3fs/step",
                             self.step, loss, grad_norm, tokens_per_step / dt, dt)
                if verdict is not None:
                    # After the step is logged: a rollback moves self.step back.
                    self._handle_bad_step(verdict, loss)
                if self.step % max(1, t.log_every) == 0:
                    self._check_stragglers(dt)
                watchdog.progress()
                if self._agree_any(self.preemption.received is not None):
                    log.warning("preemption signal: saving step %d and exiting", self.step)
                    self.events.emit("failure", self.step, failure="preempted")
                    if self.manager is not None:
                        watchdog.grace_seconds = cfg.fault.blocking_save_grace_seconds
                        self._forced_save(loss)
                    exit_code = EXIT_PREEMPTED
                    break
                if self.manager is not None and self.step < t.steps:
                    self.manager.maybe_save(self.step, self.checkpoint_state(),
                                            user_metadata=self._metadata(loss),
                                            attachments=self.hf_files)
                    if self.manager.lease_lost:  # agreed by every rank at the save
                        exit_code = EXIT_LEASE_LOST
                        break
            else:
                if self.manager is not None:
                    # The last step is always checkpointed, so a finished run can be exported.
                    # A blocking save is slow, not hung: the watchdog gives it time.
                    watchdog.grace_seconds = cfg.fault.blocking_save_grace_seconds
                    self._forced_save(self.losses[-1][1] if self.losses else None)
            crashed = False
        finally:
            watchdog.stop()
            self.preemption.uninstall()
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

    def _forced_save(self, loss: float | None) -> None:
        """Save this step now, blocking (preemption, the last step). A save that cannot
        happen (the write lease lost, the step committed by an earlier run) is logged, and
        :meth:`_checked_exit` turns it into the exit code."""
        try:
            self.manager.save(self.step, self.checkpoint_state(), force=True, block=True,
                              user_metadata=self._metadata(loss), attachments=self.hf_files)
        except LeaseLostError:
            pass  # logged by the manager; the exit code says it
        except FileExistsError as exc:
            if self.env.rank == 0:
                log.error("%s", exc)

    def _checked_exit(self, exit_code: int) -> int:
        """Exit 0 only when the last step is committed; otherwise a code and one line why."""
        m = self.manager
        if m is None:
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


def run(cfg: Config, env: DistEnv) -> int:
    """Train per ``cfg``; returns the process exit code (see trainer.distributed)."""
    try:
        trainer = Trainer(cfg, env)
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
