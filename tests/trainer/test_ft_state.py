"""What a rejoining replica group receives, and how: the replica state (trainer.ft.state),
its pickle-free encoding (trainer.ft.wire) and the HTTP transport between two processes'
worth of servers (trainer.ft.transport), in one process."""

from __future__ import annotations

import io
import random
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch

from ckpt.root import CheckpointStore
from tests.e2e._jobs import TINY
from trainer.checkpointing import TrainerState
from trainer.config import load_config
from trainer.distributed import DistEnv
from trainer.ft import ReplicaMismatchError, ReplicaState, wire
from trainer.train import Trainer

FT = ["--fault_tolerance.enabled=true", "--parallel.dp_replicate=2"]


def _trainer(group: int, *overrides: str) -> Trainer:
    cfg = load_config(str(TINY), ["--training.steps=20", *FT,
                                  f"--fault_tolerance.group_id={group}", *overrides])
    return Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))


def _train(t: Trainer, steps: int) -> None:
    for _ in range(steps):
        t.loader.seek(t.step)
        t.train_step()
        for o in t.optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        for s in t.schedulers:
            s.step()
        t.step += 1
        t.guard.check(1.0 + t.step)
        torch.rand(3)  # the random streams move on too
        random.random()


def _state(t: Trainer) -> ReplicaState:
    return ReplicaState(t.model, t.optimizers, t.schedulers, TrainerState(t))


def _roundtrip(step: int, tree):
    data = b"".join(bytes(c) for c in wire.encode(step, tree).chunks())
    return data, wire.decode(io.BytesIO(data), expect_step=step)


def test_a_received_state_makes_a_bit_identical_replica():
    """Group 1, built fresh (as a restarted group is), receives group 0's state after 4
    steps over the wire encoding: every digest matches, and both continue identically."""
    a, b = _trainer(0), _trainer(1)
    _train(a, 4)
    before = _state(b).digests()
    assert before != _state(a).digests()
    _, (step, tree) = _roundtrip(4, _state(a).state_dict())
    assert step == 4
    _state(b).load_state_dict(tree)
    assert _state(b).digests() == _state(a).digests()
    assert b.step == a.step == 4 and b.schedulers[0].last_epoch == 4
    assert list(b.guard.window) == list(a.guard.window)
    _train(a, 3)
    _train(b, 3)
    assert _state(b).digests() == _state(a).digests()


def test_a_state_from_another_model_is_refused_before_anything_changes():
    a, b = _trainer(0), _trainer(1, "--model.dim=32", "--model.ffn_dim=128")
    _train(a, 1)
    before = _state(b).digests()
    with pytest.raises(ReplicaMismatchError, match="same layout"):
        _state(b).load_state_dict(_roundtrip(1, _state(a).state_dict())[1][1])
    assert _state(b).digests() == before


def test_the_encoding_keeps_every_value_and_dtype():
    tree = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
            "i64": torch.arange(7), "bool": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
            "rng": torch.get_rng_state(), "py": random.getstate(), "nan": float("nan"),
            "nested": [{"a": (1, 2.0, None, "x")}, [torch.ones(2, dtype=torch.float16)]]}
    _, (_, out) = _roundtrip(9, tree)
    for k in ("f32", "bf16", "i64", "bool", "scalar", "empty", "rng"):
        assert out[k].dtype == tree[k].dtype and torch.equal(out[k], tree[k]), k
        assert out[k].storage_offset() == 0  # own storage: set_rng_state needs it
    assert out["py"] == tree["py"] and out["nan"] != out["nan"]
    assert out["nested"][0] == {"a": (1, 2.0, None, "x")}
    assert torch.equal(out["nested"][1][0], tree["nested"][1][0])
    torch.set_rng_state(out["rng"])  # a usable generator state
    random.setstate((out["py"][0], tuple(out["py"][1]), out["py"][2]))


def _message(header_patch=None, body_patch=None) -> bytes:
    data, _ = _roundtrip(3, {"w": torch.arange(16, dtype=torch.float32)})
    hlen = struct.unpack("<Q", data[8:16])[0]
    header, body = data[16:16 + hlen], bytearray(data[16 + hlen:])
    if header_patch:
        header = header_patch(header)
    if body_patch:
        body_patch(body)
    return wire.MAGIC + struct.pack("<Q", len(header)) + header + bytes(body)


@pytest.mark.parametrize("bad, match", [
    (lambda: b"\x80\x04\x95" + b"\0" * 40, "bad magic"),  # a pickle stream (torch.save)
    (lambda: _message()[:-5], "ends inside"),
    (lambda: _message(body_patch=lambda b: b.__setitem__(0, b[0] ^ 1)), "checksum"),
    (lambda: _message(header_patch=lambda h: h.replace(b"[16]", b"[17]")), "not 64 bytes"),
    (lambda: _message(header_patch=lambda h: h.replace(b'"float32"', b'"pickle"')),
     "unknown dtype"),
    (lambda: _message(header_patch=lambda h: h.replace(b'"body_bytes":64', b'"body_bytes":32')),
     "outside the body"),
    (lambda: _message(header_patch=lambda h: h.replace(b'"step":3', b'"step":4')),
     "expected 3"),
    (lambda: _message(header_patch=lambda h: h[:-1]), "bad header"),
])
def test_a_malformed_message_is_refused_with_what_is_wrong(bad, match):
    with pytest.raises(wire.WireError, match=match):
        wire.decode(io.BytesIO(bad()), expect_step=3)


def test_the_transport_serves_the_step_asked_and_holds_the_optimizer_back():
    pytest.importorskip("torchft")
    from trainer.ft.transport import StateTransport, TransferError

    timeout = timedelta(seconds=5)
    src, dst = StateTransport(timeout), StateTransport(timeout)
    try:
        state = {"w": torch.randn(1000), "n": 3}
        got = {}
        # A request for a step not served yet waits for it (the receiver can be faster).
        fetch = threading.Thread(target=lambda: got.update(
            r=dst.recv_checkpoint(0, src.metadata(), 7, timeout)))
        fetch.start()
        time.sleep(0.3)
        src.send_checkpoint([1], 7, state, timeout)
        fetch.join(10)
        assert torch.equal(got["r"]["w"], state["w"]) and got["r"]["n"] == 3
        src.disallow_checkpoint()  # served, then withdrawn: a late request is refused
        with pytest.raises(TransferError, match="step 7"):
            dst.recv_checkpoint(0, src.metadata(), 7, timedelta(seconds=1))
        assert src.num_sent == 1
    finally:
        src.shutdown()
        dst.shutdown()


def test_a_group_that_does_not_write_exports_the_checkpoint_age_and_its_limit(tmp_path):
    """CheckpointTooOld reads every target of the job: a replica group that does not hold
    the lease must export the store's newest commit and a finite age limit, not its own
    start time and +Inf (which would hide a writer that stopped committing)."""
    from ckpt import save
    from tests.dist import free_port

    save({"w": torch.ones(2)}, str(tmp_path), step=5)
    created = CheckpointStore(str(tmp_path)).read_manifest(5).created_unix
    t = _trainer(1, f"--checkpoint.root={tmp_path}", "--checkpoint.interval=20",
                 f"--metrics.port={free_port()}", "--metrics.host=127.0.0.1")
    try:
        assert t.manager is None and t.writer is not None  # not built before fit()
        value = t.metrics.registry.get_sample_value
        durable = {"rank": "0", "tier": "durable"}
        assert value("ckpt_last_commit_timestamp_seconds", durable) == created
        assert value("ckpt_last_committed_step", durable) == 5
        assert value("ckpt_interval_steps", {"rank": "0"}) == 20
    finally:
        t.metrics.shutdown()
