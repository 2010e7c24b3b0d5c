"""The training loop: build the parallel model, train, checkpoint, detect failures, resume.

Every rank runs :func:`run` with the same config. The loop per step: next batch (this dp
rank's slice of the global batch) -> forward/backward (pipelined when pp > 1, micro-batched
for gradient accumulation) -> global gradient norm and clipping -> loss guard (NaN/spike) ->
optimizer and LR step -> log, metrics -> preemption check -> ``maybe_save`` (the cadence
policy decides; the stall is only the staging copy). On start it resumes by itself from the
newest checkpoint under ``checkpoint.root`` that verifies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from typing import Any

import torch
import torch.distributed as dist

from ckpt.agreement import Agreement
from ckpt.errors import LeaseHeldError
from ckpt.events import EventBus, JsonlEventLog
from ckpt.stateful import RNGState, init_optimizer_state
from trainer.config import Config, ConfigError, config_fingerprint, config_to_dict
from trainer.data import build_loader, split_microbatches
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

__all__ = ["Trainer", "TrainingStopped", "check_startup"]

log = logging.getLogger("trainer")


# Extra time the hang watchdog allows a blocking (final or preemption) save.
_BLOCKING_SAVE_GRACE_SECONDS = 3600.0
# The LR schedule's inputs besides the step (training.lr_at); training.steps is the run's
# length: it moves the cosine horizon when lr_decay_steps is unset (docs/config.md).
_SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "lr_decay_steps")
_OVERRIDE_KEY = "training.override_schedule_on_resume"


def _config_record(cfg: Config) -> dict[str, Any]:
    """The resolved config as every checkpoint's ``user_metadata["config"]`` keeps it;
    storage options (which may hold credentials) by key only."""
    d = config_to_dict(cfg)
    opts = d["checkpoint"].get("storage_options")
    if opts:
        d["checkpoint"]["storage_options"] = {k: "<not stored>" for k in opts}
    return d


def _config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(section.key, checkpoint's value, this run's value)`` for every key that differs."""
    out = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        a, b = (a if isinstance(a, dict) else {}), (b if isinstance(b, dict) else {})
        for key in sorted(set(a) | set(b)):
            missing = "<unset>"
            if a.get(key, missing) != b.get(key, missing):
                out.append((f"{section}.{key}", a.get(key, missing), b.get(key, missing)))
    return out


class TrainingStopped(RuntimeError):
    """The loss guard gave up (too many bad steps, or policy 'stop')."""


class _ModelOptimState:
    """Model and optimizer state under the full model's parameter names (any layout)."""

    def __init__(self, model, optimizers):
        self.model, self.optimizers = model, optimizers

    def state_dict(self) -> dict:
        return {"model": self.model.model_state_dict(),
                "optim": self.model.optimizer_state_dict(self.optimizers)}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_model_state_dict(sd["model"])
        self.model.load_optimizer_state_dict(self.optimizers, sd["optim"])


class _ListState:
    """A list of Stateful objects (one LR scheduler per model part) as one state dict."""

    def __init__(self, items):
        self.items = items

    def state_dict(self) -> dict:
        return {str(i): it.state_dict() for i, it in enumerate(self.items)}

    def load_state_dict(self, sd: dict) -> None:
        for i, it in enumerate(self.items):
            it.load_state_dict(sd[str(i)])


class _TrainerState:
    def __init__(self, trainer: "Trainer"):
        self.t = trainer

    def state_dict(self) -> dict:
        return {"step": self.t.step, "fingerprint": self.t.fingerprint,
                "guard": self.t.guard.state_dict(), "num_skipped": self.t.num_skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.t.step = int(sd["step"])
        self.t.loaded_fingerprint = sd.get("fingerprint")
        self.t.guard.load_state_dict(sd.get("guard", {}))
        self.t.num_skipped_steps = int(sd.get("num_skipped", 0))


class Trainer:
    """One rank's view of a training job. Build on every rank, then call :meth:`fit`."""

    def __init__(self, cfg: Config, env: DistEnv, *, events: EventBus | None = None):
        from trainer import mesh as mesh_mod
        from trainer.parallelize import build_parallel_model

        self.env = env
        self.cfg = cfg = cfg.resolved(env.world_size)
        self.fingerprint = config_fingerprint(cfg)
        self.config_record = _config_record(cfg)
        self.loaded_fingerprint: str | None = None
        p, t = cfg.parallel, cfg.training
        self.par = p  # resolved and checked against the model and batch by cfg.resolved
        from trainer.model import ModelConfig as _MC

        self.model_cfg = _MC(**{f.name: getattr(cfg.model, f.name)
                                for f in dataclasses.fields(_MC)})
        # Every random stream a rank may use starts from the config's seed, so two runs of
        # one config are the same run (and a resumed one restores the streams it saved).
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        self.mesh = None
        if env.distributed:
            self.mesh = mesh_mod.build_mesh(self.par, env.device.type)
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
        dp_rank = mesh_mod.dp_mesh(self.mesh).get_local_rank() if self.mesh is not None else 0
        self.loader = build_loader(cfg, dp_rank, p.dp)
        self.step = 0
        self.num_skipped_steps = 0
        self.guard = LossGuard(cfg.fault.spike_factor, cfg.fault.spike_window)
        self.stragglers = StragglerDetector(cfg.fault.straggler_factor)
        self.nan_injector = NanInjector(cfg.fault.inject_nan_step)
        self.preemption = Preemption()
        self.events = events or EventBus(rank=env.rank)
        self.ctl_group = dist.new_group(backend="gloo") if env.distributed else None
        self.losses: list[tuple[int, float]] = []
        self.metrics = None
        if cfg.metrics.port:  # every rank, on base port + LOCAL_RANK (docs/monitoring.md)
            from monitoring import Metrics

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
        self.manager = self._build_manager() if cfg.checkpoint.enabled else None
        if self.metrics is not None and self.manager is not None:
            self.metrics.observe_store(self.manager.store)  # checkpoint age across restarts
            if self.manager.cadence is not None:
                self.events.emit("cadence", None, **self.manager.cadence.describe())

    # -- checkpointing -----------------------------------------------------------------------
    def _build_manager(self):
        from ckpt.cadence import parse_interval
        from ckpt.manager import CheckpointManager
        from ckpt.retention import KeepEvery, KeepLast, KeepPinned
        from ckpt.store import CheckpointStore

        c = self.cfg.checkpoint
        auto = dict(overhead_budget=c.overhead_budget,
                    initial_steps=max(1, min(100, self.cfg.training.steps // 4)))
        # With a local tier, root's checkpoints are lost only with a node: its 'auto' uses
        # the node-loss MTBF; the local tier's uses every failure's (docs/cadence.md).
        durable_mtbf = (c.node_loss_mtbf_hours or c.mtbf_hours) if c.local_root else c.mtbf_hours
        cadence = parse_interval(c.interval, mtbf_seconds=durable_mtbf * 3600.0, **auto)
        retention = []
        if c.keep_last > 0:
            retention.append(KeepLast(c.keep_last))
            if c.keep_every > 0:
                retention.append(KeepEvery(c.keep_every))
        layout = {"pp": self.par.pp, "dp": self.par.dp, "tp": self.par.tp,
                  "dp_replicate": self.par.dp_replicate, "dp_shard": self.par.dp_shard,
                  "dp_mode": self.par.dp_mode, "world_size": self.env.world_size}
        options = dict(storage_options=c.storage_options or None, cadence=cadence,
                       retention=retention, async_save=c.async_save, verify=c.verify,
                       layout=layout, events=self.events, raise_on_failure=c.fail_on_error,
                       job_fingerprint=self.fingerprint)
        if c.local_root:
            from ckpt.tiers import TieredCheckpointManager

            mgr = TieredCheckpointManager(
                c.root, c.local_root, local_cadence=parse_interval(
                    c.local_interval, mtbf_seconds=c.mtbf_hours * 3600.0, **auto),
                local_retention=[KeepLast(c.local_keep_last)], **options)
        else:
            mgr = CheckpointManager(c.root, **options)
        if retention:
            mgr.retention.append(KeepPinned(CheckpointStore(mgr.storage)))
        return mgr

    def _metadata(self, loss: float | None) -> dict[str, Any]:
        """A save's user metadata: the step's loss (``ckpt list`` shows it) and the config."""
        return {"loss": loss, "config": self.config_record}

    def checkpoint_state(self, with_rng: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = {
            "app": _ModelOptimState(self.model, self.optimizers),
            "sched": _ListState(self.schedulers),
            "data": self.loader,
            "trainer": _TrainerState(self),
        }
        if with_rng:
            state["rng"] = RNGState(self.env.rank)
        return state

    def resume(self) -> int | None:
        """Load the newest valid checkpoint (or ``checkpoint.load_step``); None if none."""
        if self.manager is None or not self.cfg.checkpoint.resume:
            return None
        from ckpt.errors import AllCheckpointsDamagedError

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
                self._uncommit_newer(-1)
            return None
        if manifest is None:
            log.info("no checkpoint under %s: starting fresh", c.root) if self.env.rank == 0 \
                else None
            return None
        same_layout = self._same_layout(manifest)
        if self.loaded_fingerprint and self.loaded_fingerprint != self.fingerprint:
            log.warning("checkpoint step %d was written with a different model/data/optimizer "
                        "config (fingerprint %s, now %s): the run will not continue bit for bit",
                        manifest.step, self.loaded_fingerprint, self.fingerprint)
        self._reconcile_config(manifest)
        if self.env.rank == 0:
            tier = getattr(self.manager, "resumed_tier", None)
            log.info("resumed from %s step %d%s", c.root if tier != "local" else
                     f"the local tier ({self.manager.local_root})", manifest.step,
                     "" if same_layout else f" (saved on layout {manifest.layout}, resharded)")
            self._uncommit_newer(manifest.step)
        self.events.emit("resumed", manifest.step, same_layout=same_layout)
        return manifest.step

    def _same_layout(self, manifest) -> bool:
        # The job's world size is in the layout: a node's local-tier checkpoint is written
        # by that node's ranks only (its manifest's world_size is theirs). Checkpoints
        # written before HSDP carry no dp_replicate: they were not hybrid.
        world = manifest.layout.get("world_size", manifest.world_size)
        return world == self.env.world_size and all(
            manifest.layout.get(k, default) == v for k, v, default in
            (("pp", self.par.pp, None), ("dp", self.par.dp, None), ("tp", self.par.tp, None),
             ("dp_replicate", self.par.dp_replicate, 1)))

    def _rng_if_same_layout(self, manifest) -> dict[str, Any]:
        """RNG streams resume only on the same layout (another layout draws differently);
        loaded in the same transaction as the rest, so a damaged RNG item falls back."""
        return {"rng": RNGState(self.env.rank)} if self._same_layout(manifest) else {}

    def _reconcile_config(self, manifest) -> None:
        """Right after a resume, on every rank: settle which LR schedule continues, and
        (rank 0) log in one block how this run's config differs from the checkpoint's.

        The optimizer and scheduler states restore the checkpoint's learning rate; without
        ``training.override_schedule_on_resume`` the checkpoint's schedule continues (its
        lr, min_lr, warmup_steps, lr_decay_steps), with it this config's applies from the
        resumed step on.
        """
        stored = (manifest.user_metadata or {}).get("config")
        changes = _config_changes(stored, self.config_record) if isinstance(stored, dict) \
            else []
        t = self.cfg.training
        schedule = [k for k, _, _ in changes if k in {f"training.{n}" for n in _SCHEDULE_KEYS}]
        first = self.schedulers[0].last_epoch
        if t.override_schedule_on_resume:
            for o, s in zip(self.optimizers, self.schedulers):
                for g in o.param_groups:
                    g["initial_lr"], g["lr"] = t.lr, t.lr_at(s.last_epoch)
                s.base_lrs = [t.lr for _ in o.param_groups]
                s._last_lr = [g["lr"] for g in o.param_groups]
            verdict = (f"the LR schedule of this config applies from step {manifest.step} "
                       f"({_OVERRIDE_KEY}=true; lr now {t.lr_at(first):.4g})")
        elif schedule:
            old = stored.get("training") or {}
            try:
                self.lr_schedule = dataclasses.replace(
                    t, **{k: old[k] for k in _SCHEDULE_KEYS if k in old})
            except (ConfigError, TypeError, ValueError) as exc:
                log.warning("cannot rebuild the checkpoint's LR schedule (%s): this config's "
                            "applies", exc) if self.env.rank == 0 else None
                return
            verdict = (f"the checkpoint's LR schedule continues: {', '.join(schedule)} "
                       f"{'is' if len(schedule) == 1 else 'are'} not applied; set "
                       f"{_OVERRIDE_KEY}=true to apply {'it' if len(schedule) == 1 else 'them'}"
                       f" from step {manifest.step}")
        else:
            verdict = ""
        if self.env.rank != 0 or not (changes or verdict):
            return
        lines = [f"config changes since checkpoint step {manifest.step} (checkpoint -> now):"]
        lines += [f"  {k}: {json.dumps(a)} -> {json.dumps(b)}" for k, a, b in changes] or \
            ["  (none stored to compare)" if not isinstance(stored, dict) else "  (none)"]
        if verdict:
            lines.append(verdict)
        (log.warning if schedule and not t.override_schedule_on_resume else log.info)(
            "%s", "\n".join(lines))

    def _uncommit_newer(self, step: int) -> None:
        """Rank 0, right after resuming from ``step``: un-commit every newer checkpoint.

        There are newer ones only when resume fell back past checkpoints that failed
        verification, or when ``checkpoint.load_step`` rewinds the run. Left committed, they
        would be wrong twice: this run could not save those steps again (the manager skips
        a step that is "already committed", so a finished run would end on a corrupt or
        stale checkpoint) and the next automatic resume would jump onto them. As with
        ``ckpt rollback``, nothing is deleted: each becomes a rolled-back version that
        ``ckpt restore --id`` brings back; saving the step again writes a new version.
        """
        for newer, kept, exc in self.manager.store.uncommit_newer(step):
            if exc is not None:
                log.warning("left checkpoint step %d as it is (%s)", newer, exc)
                continue
            since = f"the step {step} resumed from" if step >= 0 else "a deliberate fresh start"
            log.warning("un-committed checkpoint step %d (newer than %s; kept as rolled-back "
                        "id %s): this run writes that step again", newer, since, kept)
            self.events.emit("checkpoint_uncommitted", newer, resumed_step=step)

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
                        watchdog.grace_seconds = _BLOCKING_SAVE_GRACE_SECONDS
                        self.manager.save(self.step, self.checkpoint_state(), force=True,
                                          block=True, user_metadata=self._metadata(loss))
                    exit_code = EXIT_PREEMPTED
                    break
                if self.manager is not None and self.step < t.steps:
                    self.manager.maybe_save(self.step, self.checkpoint_state(),
                                            user_metadata=self._metadata(loss))
                    if self.manager.lease_lost:  # agreed by every rank at the save
                        exit_code = EXIT_LEASE_LOST
                        break
            else:
                if self.manager is not None:
                    # The last step is always checkpointed, so a finished run can be exported.
                    # A blocking save is slow, not hung: the watchdog gives it time.
                    watchdog.grace_seconds = _BLOCKING_SAVE_GRACE_SECONDS
                    self.manager.save(self.step, self.checkpoint_state(), force=True,
                                      block=True, user_metadata=self._metadata(
                                          self.losses[-1][1] if self.losses else None))
        finally:
            watchdog.stop()
            self.preemption.uninstall()
            if self.manager is not None:
                self.manager.close(flush=True)
            if self.metrics is not None:
                self.metrics.shutdown()
        return self._checked_exit(exit_code)

    def _checked_exit(self, exit_code: int) -> int:
        """Exit 0 only when the last step is committed; otherwise a code and one line why."""
        m = self.manager
        if m is None:
            return exit_code
        if exit_code == EXIT_LEASE_LOST or (exit_code == EXIT_OK and m.lease_lost):
            url = getattr(m, "lease_lost_url", None) or m.storage.url  # a tier's root
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


def check_startup(cfg: Config) -> None:
    """Check what the config names on storage, before any rank builds anything: a local
    ``checkpoint.root`` must be a folder or creatable as one, and ``checkpoint.load_step``
    must be a committed checkpoint. Raises :class:`ConfigError` naming the key and the fix.

    Every rank calls it (each reads the same root, so all agree); it writes nothing.
    """
    import os

    from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
    from ckpt.manifest import step_dirname
    from ckpt.store import CheckpointStore

    c = cfg.checkpoint
    if not c.enabled:
        return
    try:
        store = CheckpointStore(c.root, c.storage_options or None)
    except ValueError as exc:
        raise ConfigError(f"checkpoint.root: {exc}", key="checkpoint.root") from None
    storage = store.storage
    if storage.is_local:
        path = storage.path()
        existing = path
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ConfigError(f"checkpoint.root: {existing} is a file, not a folder; set "
                              f"--checkpoint.root to a folder (created if missing)",
                              key="checkpoint.root")
        if existing != path and not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"checkpoint.root: cannot create {path}: {existing} is not "
                              f"writable; fix its permissions or choose another root",
                              key="checkpoint.root")
    if c.local_root and "://" not in c.local_root:
        from ckpt.tiers import node_local_root

        path = os.path.abspath(os.path.expanduser(
            node_local_root(c.local_root, int(os.environ.get("GROUP_RANK", "0") or 0))))
        existing = path
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"checkpoint.local_root: cannot use {path}: {existing} is "
                              f"{'not writable' if os.path.isdir(existing) else 'a file'}; "
                              f"set --checkpoint.local_root to a writable folder on fast "
                              f"node-local storage (created if missing)",
                              key="checkpoint.local_root")
    if c.resume and c.load_step is not None:
        try:
            store.read_manifest(c.load_step)
        except CheckpointNotFoundError:
            committed = store.committed_steps() if storage.exists("") else []
            shown = ", ".join(map(str, committed[-10:]))
            fix = (f"committed steps: {'..., ' if len(committed) > 10 else ''}{shown}. Pass "
                   f"one of them, or leave checkpoint.load_step unset to resume from the "
                   f"newest" if committed else f"{c.root} holds no committed checkpoint; "
                   f"leave checkpoint.load_step unset to start fresh")
            raise ConfigError(
                f"checkpoint.load_step={c.load_step}: no committed checkpoint at "
                f"{storage.describe(step_dirname(c.load_step))}; {fix}",
                key="checkpoint.load_step") from None
        except CorruptCheckpointError as exc:
            raise ConfigError(f"checkpoint.load_step={c.load_step}: {exc}",
                              key="checkpoint.load_step") from None


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
