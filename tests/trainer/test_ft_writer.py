"""Which replica group writes checkpoints (trainer.ft.writer), in one process against a real
root: a live holder keeps the lease, an expired one loses it at the next agreed step, a
writer whose lease is taken over goes back to standby (not exit 4), a reader waits while a
takeover closes the dead writer's generation, and the last step is saved by a standby group
when the writer is gone."""

from __future__ import annotations

import time

import torch

from ckpt.events import EventBus
from ckpt.job import CheckpointManager, ManagerOptions
from ckpt.ranks import Agreement
from ckpt.root import CheckpointStore, Fence, acquire_lease, release_lease
from ckpt.storage import Storage
from trainer.ft import WriterRole


def _role(root, events=None, ttl=60.0, retry_steps=5) -> WriterRole:
    storage = Storage(str(root))
    return WriterRole(storage, lambda: CheckpointManager(str(root),
                                                         ManagerOptions(lease_ttl_seconds=ttl,
                                                                        job_name="g1",
                                                                        job_fingerprint="fp/g1"),
                                                         cadence="5"),
        agreement=Agreement(None), coordinator=True, events=events or EventBus(),
        group_id=1, ttl_seconds=ttl, retry_steps=retry_steps, fingerprint="fp/g1")


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "progress": {"step": step}}


def test_a_live_holder_keeps_the_lease_and_an_expired_one_loses_it(tmp_path):
    other = acquire_lease(Storage(str(tmp_path)), ttl_seconds=0.5, heartbeat=False,
                          job_name="g0")
    role = _role(tmp_path)
    assert not role.try_acquire(5)  # the holder's heartbeat is fresh
    assert not role.try_acquire(6)  # and this is no agreed step
    time.sleep(0.7)  # g0 stopped heartbeating (a dead group on another host): past its TTL
    assert not role.try_acquire(7)
    assert role.try_acquire(10) and role.writing
    assert role.manager.lease.took_over is not None
    role.manager.close()
    other.lease.release()


def test_a_writer_taken_over_goes_back_to_standby(tmp_path):
    events = EventBus()
    role = _role(tmp_path, events)
    assert role.try_acquire(0, now=True)
    m = role.manager
    assert m.save(5, _state(5), block=True)
    thief = acquire_lease(Storage(str(tmp_path)), force=True, heartbeat=False, job_name="g0")
    assert not m.lease.heartbeat()  # its heartbeat (every TTL/4) finds the lease taken
    m.maybe_save(10, _state(10))  # agreed at the save: no save, lease_lost
    role.check_lost(10)
    assert role.manager is None and not role.writing
    assert [(e.fields["role"], e.fields["reason"]) for e in events.of_kind("ft_writer")] == \
        [("writer", "no lease yet"), ("standby", "lease lost")]
    assert CheckpointStore(str(tmp_path)).committed_steps() == [5]  # 10 never counted
    release_lease(thief)


def test_a_reader_waits_while_a_takeover_closes_the_dead_writers_generation(tmp_path):
    storage = Storage(str(tmp_path))
    role = _role(tmp_path)
    assert role.wait_settled(0.1)  # a fresh root
    fence = Fence(storage)
    fence.mark(1, "open", "dead")
    fence.mark(2, "open", "taker")  # generation 2 is taken, 1 not closed yet
    t0 = time.monotonic()
    assert not role.wait_settled(0.5)
    assert time.monotonic() - t0 >= 0.5
    fence.close(1, [], closed_by="taker")
    assert role.wait_settled(0.1)


def test_a_standby_group_saves_the_last_step_when_the_writer_is_gone(tmp_path):
    holder = acquire_lease(Storage(str(tmp_path)), ttl_seconds=0.5, heartbeat=False,
                           job_name="g0")
    role = _role(tmp_path)
    saved = []

    def save(m):
        saved.append(m.save(20, _state(20), block=True, force=True))

    assert role.finish(20, save, timeout_seconds=10)  # after the TTL it takes over
    assert saved == [True] and CheckpointStore(str(tmp_path)).committed_steps() == [20]
    role.manager.close()
    holder.lease.release()
    # A committed last step is all a standby group waits for.
    assert _role(tmp_path).finish(20, lambda m: saved.append("again"), timeout_seconds=1)
    assert saved == [True]
