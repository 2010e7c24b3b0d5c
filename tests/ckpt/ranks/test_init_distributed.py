"""ckpt.init_distributed in one process: what it starts, where its keys go, and when not.

The restarts themselves are tested end to end in tests/e2e/test_torchrun_restarts.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import ckpt
from ckpt.ranks import torchrun as ckpt_dist
from tests.dist import free_port

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_MAX_RESTARTS")


@pytest.fixture
def env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


def _port() -> int:
    return free_port()


def test_a_plain_process_starts_no_group(env):
    assert ckpt.init_distributed() is False
    assert not dist.is_initialized() and not ckpt_dist.is_attempt_scoped()


def test_keys_are_per_attempt_only_in_a_shared_agent_store(env):
    store = dist.HashStore()
    env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    ckpt_dist.attempt_store(store).set("k", "own round")  # not shared: used as it is
    assert store.get("k") == b"own round"
    env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    ckpt_dist.attempt_store(store).set("k", "attempt 2")
    assert store.get("attempt_2/k") == b"attempt 2" and store.get("k") == b"own round"


def test_a_torchrun_worker_starts_a_scoped_group_once(env):
    port = _port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)),
                        ("RANK", "0"), ("WORLD_SIZE", "1"), ("TORCHELASTIC_RESTART_COUNT", "3"),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        env.setenv(name, value)
    assert ckpt.init_distributed("gloo", timeout_seconds=30) is True
    assert ckpt_dist.is_attempt_scoped() and dist.get_world_size() == 1
    group = dist.new_group(backend="gloo")  # as the CheckpointManager's are
    dist.barrier(group=group)
    assert server.num_keys() > 0
    with pytest.raises(RuntimeError, match="already exists"):
        ckpt.init_distributed("gloo")
    dist.destroy_process_group()
    assert not ckpt_dist.is_attempt_scoped()
