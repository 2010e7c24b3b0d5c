"""The Trainer's checkpoint glue: what a checkpoint holds, the manager that writes it, and
what a resume settles (layout match, which LR schedule continues, how the config changed).

:class:`trainer.train.Trainer` calls these; ``check_startup`` runs before any rank builds
anything. Nothing here communicates except the manager it builds (see ``ckpt.job.manager``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from ckpt import (
    Checkpointer,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    EventBus,
    KeepEvery,
    KeepLast,
    LocalTierOptions,
    ManagerOptions,
    StateMismatchError,
    Storage,
    TieredCheckpointManager,
    parse_interval,
)
from ckpt.dcp import pack_optimizer_state, param_group_names, unpack_optimizer_state
from ckpt.format import step_dirname
from ckpt.job import node_local_root
from ckpt.ranks import SlurmJob
from trainer.config import Config, ConfigError, ParallelConfig, TrainingConfig, config_to_dict

__all__ = [
    "ModelOptimState",
    "ListState",
    "TrainerState",
    "build_cadence",
    "build_manager",
    "manager_options",
    "local_tier_options",
    "check_startup",
    "config_changes",
    "config_record",
    "reconcile_config",
    "replica_group_fingerprint",
    "same_layout",
    "state_mismatch_error",
]

log = logging.getLogger("trainer")

# The LR schedule's inputs besides the step (training.lr_at); training.steps is the run's
# length: it moves the cosine horizon when lr_decay_steps is unset (docs/config.md).
_SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "lr_decay_steps")
_OVERRIDE_KEY = "training.override_schedule_on_resume"


def config_record(cfg: Config) -> dict[str, Any]:
    """The resolved config as every checkpoint's ``user_metadata["config"]`` keeps it;
    storage options (which may hold credentials) by key only."""
    d = config_to_dict(cfg)
    opts = d["checkpoint"].get("storage_options")
    if opts:
        d["checkpoint"]["storage_options"] = {k: "<not stored>" for k in opts}
    return d


# Keys that name one replica group of a job, not the job: a group resuming from another
# group's checkpoint has not changed its config.
_GROUP_KEYS = {"fault_tolerance.group_id", "fault_tolerance.hostname", "metrics.jsonl_path"}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(section.key, checkpoint's value, this run's value)`` for every key that differs
    (between replica groups of one job, the keys that tell the groups apart do not count)."""
    out = []
    groups = all((d.get("fault_tolerance") or {}).get("enabled") for d in (old, new))
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        a, b = (a if isinstance(a, dict) else {}), (b if isinstance(b, dict) else {})
        for key in sorted(set(a) | set(b)):
            missing = "<unset>"
            if groups and f"{section}.{key}" in _GROUP_KEYS:
                continue
            if a.get(key, missing) != b.get(key, missing):
                out.append((f"{section}.{key}", a.get(key, missing), b.get(key, missing)))
    return out


class ModelOptimState:
    """Model and optimizer state under the full model's parameter names (any layout); the
    optimizer's param groups and step counters once per group (``ckpt.dcp.optim_state``)."""

    def __init__(self, model, optimizers):
        self.model, self.optimizers = model, optimizers

    def state_dict(self) -> dict:
        model_sd = self.model.model_state_dict()
        groups = [param_group_names(part, optim)
                  for part, optim in zip(self.model.model_parts, self.optimizers)]
        return {"model": model_sd,
                "optim": pack_optimizer_state(self.model.optimizer_state_dict(self.optimizers),
                                              groups=groups, params=model_sd)}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_model_state_dict(sd["model"])
        self.model.load_optimizer_state_dict(self.optimizers, unpack_optimizer_state(sd["optim"]))


class ListState:
    """A list of Stateful objects (one LR scheduler per model part) as one state dict."""

    def __init__(self, items):
        self.items = items

    def state_dict(self) -> dict:
        return {str(i): it.state_dict() for i, it in enumerate(self.items)}

    def load_state_dict(self, sd: dict) -> None:
        for i, it in enumerate(self.items):
            it.load_state_dict(sd[str(i)])


class TrainerState:
    """The trainer's own counters (step, loss guard, skipped steps) and the config
    fingerprint, read from and written to a :class:`trainer.train.Trainer`."""

    def __init__(self, trainer: Any):
        self.t = trainer

    def state_dict(self) -> dict:
        return {"step": self.t.step, "fingerprint": self.t.fingerprint,
                "guard": self.t.guard.state_dict(), "num_skipped": self.t.num_skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.t.step = int(sd["step"])
        self.t.loaded_fingerprint = sd.get("fingerprint")
        self.t.guard.load_state_dict(sd.get("guard", {}))
        self.t.num_skipped_steps = int(sd.get("num_skipped", 0))


def _auto_options(cfg: Config) -> dict[str, Any]:
    return dict(overhead_budget=cfg.checkpoint.overhead_budget,
                initial_steps=max(1, min(100, cfg.training.steps // 4)))


def build_cadence(cfg: Config):
    """The durable tier's cadence policy for ``cfg.checkpoint`` (what the manager uses; a
    replica group that does not write describes it to its metrics all the same)."""
    c = cfg.checkpoint
    # With a local tier, root's checkpoints are lost only with a node: its 'auto' uses
    # the node-loss MTBF; the local tier's uses every failure's (docs/cadence.md).
    durable_mtbf = (c.node_loss_mtbf_hours or c.mtbf_hours) if c.local_root else c.mtbf_hours
    return parse_interval(c.interval, mtbf_seconds=durable_mtbf * 3600.0, **_auto_options(cfg))


def manager_options(cfg: Config, world_size: int, fingerprint: str,
                    par: ParallelConfig | None = None) -> ManagerOptions:
    """``cfg.checkpoint`` (and the fault-tolerance keys the lease depends on) as the
    manager's options, field by field: cadence, retention, the layout recorded in every
    manifest, the lease's name, fingerprint and TTL.

    ``par``: the layout of the ranks that save (default ``cfg.parallel``). With fault
    tolerance it is one replica group's (``world_size`` its ranks): the writing group saves
    a whole replica, which any group, or a job without fault tolerance, loads. The lease
    then has ``fault_tolerance.lease_ttl_seconds`` and a name and fingerprint per group,
    so that only this group's own earlier attempt counts as proven dead (``ckpt.root.lease``).

    Under Slurm the lease record and the run log name the job and its requeues
    (``slurm-<job id>-restart-<n>``, :class:`ckpt.ranks.SlurmJob`), also before the
    replica group's name.
    """
    c, ft = cfg.checkpoint, cfg.fault_tolerance
    par = par or cfg.parallel
    retention = []
    if c.keep_last > 0:  # pinned steps are kept whatever the policies
        retention.append(KeepLast(c.keep_last))
        if c.keep_every > 0:
            retention.append(KeepEvery(c.keep_every))
    layout = {"pp": par.pp, "dp": par.dp, "tp": par.tp,
              "dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard,
              "dp_mode": par.dp_mode, "ep": par.ep, "world_size": world_size}
    slurm = SlurmJob.from_env()
    job_name, lease = (slurm.name if slurm else None), {}
    if ft.enabled:
        layout["replica_groups"] = cfg.parallel.dp_replicate
        group = f"replica-group-{ft.group_id}"
        job_name = f"{slurm.name}/{group}" if slurm else group
        lease = dict(lease_ttl_seconds=ft.lease_ttl_seconds)
        fingerprint = replica_group_fingerprint(fingerprint, ft.group_id)
    return ManagerOptions(
        cadence=build_cadence(cfg), retention=retention, async_save=c.async_save,
        verify=c.verify, raise_on_failure=c.fail_on_error, layout=layout,
        storage_options=c.storage_options or None, job_name=job_name,
        job_fingerprint=fingerprint, **lease)


def local_tier_options(cfg: Config) -> LocalTierOptions:
    """``cfg.checkpoint``'s local tier (``local_interval``, ``local_keep_last``,
    ``local_copies``) as the tiered manager's local options."""
    c = cfg.checkpoint
    return LocalTierOptions(
        cadence=parse_interval(c.local_interval, mtbf_seconds=c.mtbf_hours * 3600.0,
                               **_auto_options(cfg)),
        retention=[KeepLast(c.local_keep_last)], copies=c.local_copies)


def build_manager(cfg: Config, world_size: int, events: EventBus, fingerprint: str,
                  par: ParallelConfig | None = None
                  ) -> Checkpointer:
    """The job's checkpoint manager for ``cfg.checkpoint`` (tiered when ``local_root`` is
    set), with :func:`manager_options`. Every rank builds it."""
    options = manager_options(cfg, world_size, fingerprint, par)
    c = cfg.checkpoint
    if c.local_root:
        return TieredCheckpointManager(c.root, c.local_root, options,
                                       local=local_tier_options(cfg), events=events)
    return CheckpointManager(c.root, options, events=events)


def replica_group_fingerprint(fingerprint: str, group_id: int) -> str:
    """The lease fingerprint of replica group ``group_id``: the same job's other groups are
    other writers, never an "earlier attempt" whose lease may be taken at once."""
    return f"{fingerprint}/replica-group-{group_id}"


def same_layout(manifest, par: ParallelConfig, world_size: int) -> bool:
    """Was the checkpoint of ``manifest`` written on this layout (``par`` on ``world_size``
    ranks)? Then RNG streams resume too; otherwise the state is resharded."""
    # The job's world size is in the layout: a node's local-tier checkpoint is written
    # by that node's ranks only (its manifest's world_size is theirs). Checkpoints
    # written before HSDP carry no dp_replicate: they were not hybrid; nor ep before
    # expert parallelism.
    world = manifest.layout.get("world_size", manifest.world_size)
    return world == world_size and all(
        manifest.layout.get(k, default) == v for k, v, default in
        (("pp", par.pp, None), ("dp", par.dp, None), ("tp", par.tp, None),
         ("dp_replicate", par.dp_replicate, 1), ("ep", par.ep, 1)))


def state_mismatch_error(exc: StateMismatchError, root: str) -> ValueError:
    """A resume's refusal of a checkpoint saved from another model (a dense one into a
    mixture of experts, other sizes, ...) as one line naming the first key that differs
    (the store lists them all; a dense MLP is ``feed_forward``, an MoE block's ``moe``)."""
    if exc.missing:
        first, where = exc.missing[0], "this model has it, the checkpoint does not"
    elif exc.unexpected:
        first, where = exc.unexpected[0], "the checkpoint has it, this model does not"
    else:
        first, where = exc.mismatched[0].split(": ", 1)
    count = len(exc.missing) + len(exc.unexpected) + len(exc.mismatched)
    return ValueError(f"checkpoint under {root} was saved from another model: {first}: "
                      f"{where} ({count} key(s) differ); resume with the [model] keys it was "
                      "saved with (`ckpt show` prints its config) or use another "
                      "checkpoint.root")


def reconcile_config(manifest, training: TrainingConfig, record: dict[str, Any], optimizers,
                     schedulers, rank: int) -> TrainingConfig | None:
    """Right after a resume, on every rank: settle which LR schedule continues, and
    (rank 0) log in one block how this run's config differs from the checkpoint's.

    The optimizer and scheduler states restore the checkpoint's learning rate; without
    ``training.override_schedule_on_resume`` the checkpoint's schedule continues (its
    lr, min_lr, warmup_steps, lr_decay_steps), with it this config's applies from the
    resumed step on. ``record`` is this run's :func:`config_record`. Returns the
    checkpoint's schedule when it continues, else None (this config's schedule applies).
    """
    stored = (manifest.user_metadata or {}).get("config")
    changes = config_changes(stored, record) if isinstance(stored, dict) else []
    t = training
    lr_schedule = None
    schedule = [k for k, _, _ in changes if k in {f"training.{n}" for n in _SCHEDULE_KEYS}]
    first = schedulers[0].last_epoch
    if t.override_schedule_on_resume:
        for o, s in zip(optimizers, schedulers):
            for g in o.param_groups:
                g["initial_lr"], g["lr"] = t.lr, t.lr_at(s.last_epoch)
            s.base_lrs = [t.lr for _ in o.param_groups]
            s._last_lr = [g["lr"] for g in o.param_groups]
        verdict = (f"the LR schedule of this config applies from step {manifest.step} "
                   f"({_OVERRIDE_KEY}=true; lr now {t.lr_at(first):.4g})")
    elif schedule:
        old = stored.get("training") or {}
        try:
            lr_schedule = dataclasses.replace(
                t, **{k: old[k] for k in _SCHEDULE_KEYS if k in old})
        except (ConfigError, TypeError, ValueError) as exc:
            log.warning("cannot rebuild the checkpoint's LR schedule (%s): this config's "
                        "applies", exc) if rank == 0 else None
            return None
        verdict = (f"the checkpoint's LR schedule continues: {', '.join(schedule)} "
                   f"{'is' if len(schedule) == 1 else 'are'} not applied; set "
                   f"{_OVERRIDE_KEY}=true to apply {'it' if len(schedule) == 1 else 'them'}"
                   f" from step {manifest.step}")
    else:
        verdict = ""
    if rank != 0 or not (changes or verdict):
        return lr_schedule
    lines = [f"config changes since checkpoint step {manifest.step} (checkpoint -> now):"]
    lines += [f"  {k}: {json.dumps(a)} -> {json.dumps(b)}" for k, a, b in changes] or \
        ["  (none stored to compare)" if not isinstance(stored, dict) else "  (none)"]
    if verdict:
        lines.append(verdict)
    (log.warning if schedule and not t.override_schedule_on_resume else log.info)(
        "%s", "\n".join(lines))
    return lr_schedule


def check_startup(cfg: Config) -> None:
    """Check what the config names on storage, before any rank builds anything: a local
    ``checkpoint.root`` must be a folder or creatable as one, and ``checkpoint.load_step``
    must be a committed checkpoint. Raises :class:`ConfigError` naming the key and the fix.

    Every rank calls it (each reads the same root, so all agree); it writes nothing.
    """
    c = cfg.checkpoint
    if not c.enabled:
        return
    try:
        store = CheckpointStore(c.root, c.storage_options or None)
    except ValueError as exc:
        raise ConfigError(f"checkpoint.root: {exc}", key="checkpoint.root") from None
    path = store.storage.local_path()
    if path is not None:
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
    if c.local_root:
        path = Storage(node_local_root(c.local_root, int(os.environ.get("GROUP_RANK", "0")
                                                         or 0))).local_path()
    if c.local_root and path is not None:
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
            committed = store.committed_steps() if store.storage.exists("") else []
            shown = ", ".join(map(str, committed[-10:]))
            fix = (f"committed steps: {'..., ' if len(committed) > 10 else ''}{shown}. Pass "
                   f"one of them, or leave checkpoint.load_step unset to resume from the "
                   f"newest" if committed else f"{c.root} holds no committed checkpoint; "
                   f"leave checkpoint.load_step unset to start fresh")
            raise ConfigError(
                f"checkpoint.load_step={c.load_step}: no committed checkpoint at "
                f"{store.storage.describe(step_dirname(c.load_step))}; {fix}",
                key="checkpoint.load_step") from None
        except CorruptCheckpointError as exc:
            raise ConfigError(f"checkpoint.load_step={c.load_step}: {exc}",
                              key="checkpoint.load_step") from None

