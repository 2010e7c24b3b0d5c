"""Replicated optimizer values saved once (``ckpt.dcp.optim_state``), and every older or
other form still loading bit for bit.

* Write items per rank: the shards (a parameter and its two AdamW moments) plus a constant,
  for ``ModelState`` and for the trainer's state; before, 16 per parameter (13 replicas:
  12 hyperparameters and the step counter).
* Step counters come back exactly, one tensor per parameter with the optimizer's dtype,
  from a group's counters saved as one tensor (equal or not: a parameter that skipped
  steps), or from a checkpoint written before packing (a counter per parameter),
  in one process, on 2 FSDP2 ranks and resharded between them; the trainer resumes such
  a checkpoint bit for bit.
* Pipeline stages (each rank its own parameters and groups, flattened as the trainer saves
  them) save under different group keys and load into one process, and back.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import ckpt
from ckpt.dcp import (
    ModelState,
    SafeSavePlanner,
    pack_optimizer_state,
    resolve_state,
    unpack_optimizer_state,
)
from ckpt.root import CheckpointStore
from tests.ckpt._helpers import assert_same, pack, unpack
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(300)


def _mlp(seed: int, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(layers)])


def _adamw(model, lr: float = 1e-2) -> torch.optim.Optimizer:
    params = list(model.parameters())
    # Two groups, as a weight-decay split makes them.
    return torch.optim.AdamW([{"params": params[::2]},
                              {"params": params[1::2], "weight_decay": 0.0}], lr=lr)


def _train(model, optim, steps: int, seed: int = 0, frozen=()) -> None:
    for i in range(steps):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed + i))
        model(x).square().mean().backward()
        for p in frozen:
            p.grad = None  # AdamW skips it: its step counter falls behind
        optim.step()
        optim.zero_grad(set_to_none=True)


def _full(model, optim) -> dict:
    """Model and optimizer state (unpacked), every DTensor gathered (collective)."""
    def full(v):
        if isinstance(v, dict):
            return {k: full(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(full(x) for x in v)
        if isinstance(v, torch.Tensor):
            return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        return v

    model_sd, optim_sd = get_state_dict(model, optim)
    return full({"model": model_sd, "optim": optim_sd})


def _num_items(state: dict) -> int:
    planner = SafeSavePlanner()
    planner.set_up_planner(resolve_state(state), None, True)
    return len(planner.create_local_plan().items)


def test_a_rank_writes_its_shards_plus_a_constant():
    counts = {}
    for layers in (2, 6):
        model = _mlp(0, layers)
        optim = _adamw(model)
        _train(model, optim, 1)
        num_params = len(list(model.parameters()))
        counts[layers] = (num_params, _num_items({"app": ModelState(model, optim)}))
    (p2, n2), (p6, n6) = counts[2], counts[6]
    assert n6 - n2 == 3 * (p6 - p2), counts  # a parameter and its two moments, nothing else
    assert n2 - 3 * p2 == 4, counts  # per group: its hyperparameters and its step counter


def test_the_trainers_state_is_its_shards_plus_a_constant():
    from tests.e2e._jobs import ROOT
    from trainer.config import load_config
    from trainer.distributed import DistEnv
    from trainer.train import Trainer

    counts = {}
    for layers in (2, 4):
        cfg = load_config(str(ROOT / "configs" / "tiny.toml"),
                          [f"--model.n_layers={layers}", "--training.steps=1"])
        t = Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))
        num_params = len(t.model.model_state_dict())
        counts[layers] = (num_params, _num_items(t.checkpoint_state()))
    (p2, n2), (p4, n4) = counts[2], counts[4]
    assert n4 - n2 == 3 * (p4 - p2), counts
    # The rest: one param group (hyperparameters, step), the scheduler, data position,
    # trainer counters and RNG: 21 items today, whatever the model's size.
    assert n2 - 3 * p2 < 30, counts


def test_counters_come_back_exactly_from_every_form(tmp_path):
    root = str(tmp_path / "root")
    model = _mlp(0, 3)
    optim = _adamw(model)
    _train(model, optim, 3)
    lagging = list(model.parameters())[2]  # in group 0: its counters then differ
    saved = {}
    ckpt.save({"app": ModelState(model, optim)}, root, 1)  # equal counters
    saved[1] = _full(model, optim)
    _train(model, optim, 2, seed=10, frozen=[lagging])
    ckpt.save({"app": ModelState(model, optim)}, root, 2)  # one of group 0's lags
    saved[2] = _full(model, optim)
    assert float(optim.state[lagging]["step"]) == 3.0
    model_sd, optim_sd = get_state_dict(model, optim)  # the form saved before packing
    ckpt.save({"app": {"model": model_sd, "optim": optim_sd}}, root, 3)
    saved[3] = saved[2]
    store = CheckpointStore(root)
    keys = {s: set(store.read_manifest(s).tensors) | set(store.read_manifest(s).objects)
            for s in (1, 2, 3)}
    steps = {s: sorted(k for k in keys[s] if k.endswith((".step", ".steps"))) for s in keys}
    # One counter tensor per group, whatever the values: the same keys at steps 1 and 2.
    assert steps[1] == steps[2] == ["app.optim.groups.0.bias.steps",
                                    "app.optim.groups.0.weight.steps"]
    assert len(steps[3]) == 6 and "app.optim.param_groups.1.lr" in keys[3]
    for step in (1, 2, 3):
        fresh = _mlp(5, 3)
        fresh_optim = _adamw(fresh, lr=0.5)
        _train(fresh, fresh_optim, 1, seed=99)
        ckpt.load({"app": ModelState(fresh, fresh_optim)}, root, step)
        assert_same(saved[step], _full(fresh, fresh_optim), f"step {step}")
        counters = [fresh_optim.state[p]["step"] for p in fresh.parameters()]
        assert len({id(c) for c in counters}) == len(counters)  # one tensor each
        assert all(c.dtype == torch.float32 for c in counters)
        # And the run goes on exactly as the saved one would.
        twin = copy.deepcopy(model)
        twin_optim = _adamw(twin)
        twin_optim.load_state_dict(copy.deepcopy(optim.state_dict()))
        if step == 1:
            continue  # the saved run moved on since; steps 2 and 3 are its present
        _train(twin, twin_optim, 2, seed=50)
        _train(fresh, fresh_optim, 2, seed=50)
        for a, b in zip(twin.parameters(), fresh.parameters()):
            assert torch.equal(a, b), f"step {step}"


def test_different_hyperparameters_in_one_group_are_refused(tmp_path):
    root = str(tmp_path / "root")
    model = _mlp(0, 2)
    optim = _adamw(model)
    _train(model, optim, 1)
    ckpt.save({"app": ModelState(model, optim)}, root, 1)
    fresh = _mlp(1, 2)
    one_group = torch.optim.AdamW(fresh.parameters(), lr=1e-2)  # the two groups merged
    _train(fresh, one_group, 1)
    with pytest.raises(ValueError, match="different optimizer hyperparameters for 0.weight"):
        ckpt.load({"app": ModelState(fresh, one_group)}, root, 1)


def _fsdp(seed: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _mlp(seed, 2)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, _adamw(model)


def _fsdp_body(rank: int, world: int, root: str) -> dict:
    model, optim = _fsdp(0, world)
    _train(model, optim, 2)
    model_sd, optim_sd = get_state_dict(model, optim)
    ckpt.save({"app": {"model": model_sd, "optim": optim_sd}}, root, 1)  # before packing
    expected = {"expanded": _full(model, optim)}
    _train(model, optim, 1, seed=7)
    ckpt.save({"app": ModelState(model, optim)}, root, 2)
    expected["packed"] = _full(model, optim)
    for step, name in ((2, "packed"), (1, "expanded")):
        fresh, fresh_optim = _fsdp(3, world)
        _train(fresh, fresh_optim, 1, seed=40)
        ckpt.load({"app": ModelState(fresh, fresh_optim)}, root, step)
        assert_same(expected[name], _full(fresh, fresh_optim), f"FSDP2, {name}")
    return {name: pack(value) for name, value in expected.items()}


def test_expanded_and_packed_checkpoints_reshard_between_fsdp2_and_one_process(tmp_path):
    root = str(tmp_path / "root")
    results = run_ranks(_fsdp_body, 2, root, timeout=240)
    store = CheckpointStore(root)
    expanded, packed = (set(store.read_manifest(s).objects) for s in (1, 2))
    assert "app.optim.param_groups.0.lr" in expanded
    assert "app.optim.groups.0.weight.hyper" in packed
    assert not any(".param_groups." in k for k in packed)
    for step, name in ((1, "expanded"), (2, "packed")):
        expected = unpack(results[0][name])
        model = _mlp(8, 2)
        optim = _adamw(model)
        _train(model, optim, 1, seed=60)
        ckpt.load({"app": ModelState(model, optim)}, root, step)
        assert_same(expected, _full(model, optim), f"one process, {name}")


class _Stage:
    """A pipeline stage's model and optimizer state, flattened as the trainer's (keys by
    parameter name), its param groups packed."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self):
        return {"model": get_model_state_dict(self.model),
                "optim": pack_optimizer_state(get_optimizer_state_dict(
                    self.model, self.optim, options=self.options))}

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd["model"])
        set_optimizer_state_dict(self.model, self.optim, unpack_optimizer_state(sd["optim"]),
                                 options=self.options)


def _stages(seed: int, layers: list[int]):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in layers})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optim, seed: int) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
    sum(layer(x).square().mean() for layer in model.values()).backward()
    optim.step()
    optim.zero_grad()


def _stage_body(rank: int, world: int, root: str, whole: bytes) -> dict:
    model, optim = _stages(rank, [rank])  # rank r holds layer r, as pipeline stage r
    _step(model, optim, rank)
    ckpt.save({"app": _Stage(model, optim)}, root, 1)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # Back: the one-process checkpoint (step 2) loads into each stage's own layer.
    ckpt.load({"app": _Stage(model, optim)}, root, 2)
    expected = unpack(whole)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected["model"][k]), k
    counters = {n: optim.state[p]["step"] for n, p in model.named_parameters()}
    return {"saved": pack(saved), "counters": pack(counters)}


def test_pipeline_stages_save_their_own_groups_and_reshard_to_one_process_and_back(tmp_path):
    root = str(tmp_path / "root")
    whole, whole_optim = _stages(5, [0, 1])
    for i in range(3):
        _step(whole, whole_optim, 20 + i)
    ckpt.save({"app": _Stage(whole, whole_optim)}, root, 2)
    expected = {"model": {k: v.detach().clone() for k, v in whole.state_dict().items()}}
    results = run_ranks(_stage_body, 2, root, pack(expected), timeout=180)
    for out in results:  # the one-process counters (3 steps) on each stage
        assert all(float(c) == 3.0 for c in unpack(out["counters"]).values())
    manifest = CheckpointStore(root).read_manifest(1)
    groups = sorted(k for k in manifest.objects if k.startswith("app.optim.groups."))
    assert groups == ["app.optim.groups.0.weight.hyper", "app.optim.groups.1.weight.hyper"]
    # Both stages' layers and counters load into one process.
    model, optim = _stages(9, [0, 1])
    _step(model, optim, 99)
    _step(model, optim, 98)
    ckpt.load({"app": _Stage(model, optim)}, root, 1)
    for rank, out in enumerate(results):
        for k, v in unpack(out["saved"]).items():
            assert torch.equal(model.state_dict()[k], v), k
    assert [float(optim.state[p]["step"]) for p in model.parameters()] == [1.0] * 4


def test_a_trainer_checkpoint_written_before_packing_resumes_bit_for_bit(tmp_path):
    from tests.e2e._jobs import ROOT
    from trainer.config import load_config
    from trainer.distributed import DistEnv
    from trainer.train import Trainer

    env = DistEnv(0, 1, 0, torch.device("cpu"), None, 0)

    def trainer(steps: int, *overrides: str) -> Trainer:
        cfg = load_config(str(ROOT / "configs" / "tiny.toml"),
                          [f"--training.steps={steps}", "--checkpoint.interval=100",
                           *overrides])
        return Trainer(cfg, env)

    straight = trainer(6)
    assert straight.fit() == 0
    new_root, old_root = tmp_path / "new", tmp_path / "old"
    first = trainer(3, f"--checkpoint.root={new_root}")
    assert first.fit() == 0  # its final save: step 3, packed
    manifest = CheckpointStore(str(new_root)).read_manifest(3)
    # The same state as the trainer saved it before packing (param groups per parameter).
    state = resolve_state(first.checkpoint_state())
    state["app"] = {"model": first.model.model_state_dict(),
                    "optim": first.model.optimizer_state_dict(first.optimizers)}
    ckpt.save(state, str(old_root), 3, user_metadata=manifest.user_metadata,
              layout=manifest.layout)
    old_keys = set(CheckpointStore(str(old_root)).read_manifest(3).objects)
    assert "app.optim.param_groups.tok_embeddings.weight.lr" in old_keys
    assert not any(".groups." in k for k in old_keys)
    assert any(".groups." in k for k in manifest.objects), "the trainer's own is packed"
    for root in (old_root, new_root):
        resumed = trainer(6, f"--checkpoint.root={root}")
        assert resumed.fit() == 0
        assert resumed.losses == straight.losses[3:], root
