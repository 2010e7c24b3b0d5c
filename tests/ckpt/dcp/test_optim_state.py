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
* Packed groups are the optimizer's (with their index), not parameters with equal values:
  groups whose lrs diverged load into groups that start equal, flattened and not; what does
  not fit the optimizer is a StateMismatchError naming group and key, also from
  load_latest; checkpoints packed before groups had an index still load.
* ``init_optimizer_state`` (and a save before the first step) changes no step of any
  ``torch.optim`` optimizer, bit for bit, and touches no parameter, gradient or hook.
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
    init_optimizer_state,
    pack_optimizer_state,
    param_group_names,
    unpack_optimizer_state,
)
from ckpt.dcp.api import resolve_state
from ckpt.dcp.planners import SafeSavePlanner
from ckpt.errors import CorruptCheckpointError, StateMismatchError
from ckpt.export._consolidate import consolidate
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
                    self.model, self.optim, options=self.options),
                    groups=[param_group_names(self.model, self.optim)])}

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


# -- init_optimizer_state: the state a first step makes, and nothing else ---------------------
# (every optimizer's steps with it, saved and resumed: test_optim_trajectory.py)
_O = torch.optim


def test_init_optimizer_state_makes_the_first_steps_state_and_touches_nothing_else():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.bias[0] = -0.0  # a stepped parameter would come back +0.0 (maximize, lr 0)
    optim = _O.Adam(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True,
                    maximize=True)
    calls = []
    optim.register_step_pre_hook(lambda *a: calls.append("pre"))
    optim.register_step_post_hook(lambda *a: calls.append("post"))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()  # gradients there already: kept as they are
    grads = [p.grad.clone() for p in model.parameters()]
    init_optimizer_state(optim)
    assert calls == []
    for p, b, g in zip(model.parameters(), before, grads):
        assert torch.equal(p, b) and torch.equal(p.signbit(), b.signbit())
        assert torch.equal(p.grad, g)
    for p in model.parameters():
        st = optim.state[p]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        assert float(st["step"]) == 0.0 and st["step"].dtype == torch.float32
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert torch.equal(st[k], torch.zeros_like(p)) and not st[k].signbit().any(), k
    # Initial values other than zero, as the optimizers' own first steps make them.
    optim = _O.Rprop(model.parameters(), lr=3e-3)
    init_optimizer_state(optim)
    assert torch.equal(optim.state[model.weight]["step_size"], torch.full((2, 3), 3e-3))
    optim = _O.Adagrad(model.parameters(), initial_accumulator_value=0.25, weight_decay=0.1)
    init_optimizer_state(optim)
    assert torch.equal(optim.state[model.weight]["sum"], torch.full((2, 3), 0.25))
    optim = _O.NAdam(model.parameters(), weight_decay=0.1)
    init_optimizer_state(optim)
    assert float(optim.state[model.weight]["mu_product"]) == 1.0
    # Frozen parameters get no state, as no step gives them any; a second call does nothing.
    model.bias.requires_grad_(False)
    optim = _O.AdamW(model.parameters(), lr=1e-2)
    init_optimizer_state(optim)
    assert model.bias not in optim.state and model.weight in optim.state
    optim.state[model.weight]["exp_avg"].fill_(1.0)
    init_optimizer_state(optim)
    assert float(optim.state[model.weight]["exp_avg"].min()) == 1.0
    with pytest.raises(ValueError, match="LBFGS keeps one state for all its parameters"):
        init_optimizer_state(_O.LBFGS(model.parameters()))


# -- packed groups are the optimizer's groups; what does not fit is a state mismatch ----------
class _ByValue(_Stage):
    """Flattened, packed without the optimizer's groups (the parameters with equal values)."""

    def state_dict(self):
        return {"model": get_model_state_dict(self.model),
                "optim": pack_optimizer_state(get_optimizer_state_dict(
                    self.model, self.optim, options=self.options))}


def _layerwise(flat, seed: int = 0):
    """Two groups whose lrs start equal and then diverge (a layer-wise schedule); ``flat``:
    False, True or "by value" (flattened without the groups)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = _O.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}],
                     lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, [lambda k: 1.0, lambda k: 0.5 ** k])
    init_optimizer_state(optim)
    kind = {False: ModelState, True: _Stage, "by value": _ByValue}[flat]
    return model, optim, sched, kind(model, optim)


def _seq_step(model, optim, sched, seed: int) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()
    sched.step()


@pytest.mark.parametrize("flat", [True, False, "by value"],
                         ids=["flattened", "unflattened", "flattened-without-groups"])
def test_groups_whose_lrs_diverged_load_into_groups_that_start_equal(flat, tmp_path):
    root = str(tmp_path / "root")
    model, optim, sched, state = _layerwise(flat)
    for i in range(3):
        _seq_step(model, optim, sched, i)
    ckpt.save({"app": state, "sched": sched}, root, 3)
    fresh, fresh_optim, fresh_sched, fresh_state = _layerwise(flat, seed=1)
    assert [g["lr"] for g in fresh_optim.param_groups] == [1e-3, 1e-3]
    ckpt.load({"app": fresh_state, "sched": fresh_sched}, root, 3)
    assert [g["lr"] for g in fresh_optim.param_groups] == [1e-3, 1e-3 / 8]
    for i in range(3):  # and the run goes on as the saved one does
        for m, o, s in ((model, optim, sched), (fresh, fresh_optim, fresh_sched)):
            _seq_step(m, o, s, 10 + i)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    # The optimizer's groups, by index, in either form (packed without them: none).
    hyper = consolidate(root, 3)[0]["app"]["optim"]["groups"]
    assert {k: v["hyper"][1] for k, v in hyper.items()} == (
        {"0.weight": None, "1.weight": None} if flat == "by value" else
        {"0.weight": 0, "1.weight": 1})


def test_flattened_groups_are_the_optimizers_even_with_equal_values(tmp_path):
    """Two groups with equal values stay two groups (packing by equal values merged them,
    and a torch optimizer state exported from them had one group)."""
    from ckpt.export._optim import to_torch_optimizer_state

    root = str(tmp_path / "root")
    model, optim, sched, state = _layerwise(True)
    _seq_step(model, optim, sched, 0)
    ckpt.save({"app": state}, root, 1)
    saved = consolidate(root, 1)[0]["app"]["optim"]
    assert {k: v["hyper"][1] for k, v in saved["groups"].items()} == {"0.weight": 0,
                                                                      "1.weight": 1}
    twin = _O.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}])
    twin.load_state_dict(to_torch_optimizer_state(saved))  # torch's own check: two groups
    assert [len(g["params"]) for g in twin.param_groups] == [2, 2]
    # Without the groups, the parameters with equal values (index None); names that do not
    # fit the state dict are refused.
    osd = get_optimizer_state_dict(model, optim, options=state.options)
    assert [v["hyper"][1] for v in pack_optimizer_state(osd)["groups"].values()] == [None,
                                                                                     None]
    with pytest.raises(ValueError, match="parameter 1.bias of the optimizer state dict is "
                                         "in no group given"):
        pack_optimizer_state(osd, groups=[[["0.weight", "0.bias"], ["1.weight"]]])
    with pytest.raises(ValueError, match="parameter module.0.weight .param group 0. has no "
                                         "hyperparameters"):
        pack_optimizer_state(osd, groups=[[["module.0.weight"]]])


def test_what_does_not_fit_the_optimizer_is_a_state_mismatch_naming_group_and_key(tmp_path):
    root = str(tmp_path / "root")
    model = _mlp(0, 2)
    optim = _adamw(model)
    _train(model, optim, 1)
    flat_root = str(tmp_path / "flat")
    ckpt.save({"app": ModelState(model, optim)}, root, 1)  # no LR scheduler: no initial_lr
    ckpt.save({"app": _Stage(model, optim)}, flat_root, 1)
    for where, kind in ((root, ModelState), (flat_root, _Stage)):
        fresh = _mlp(1, 2)
        fresh_optim = _adamw(fresh)
        torch.optim.lr_scheduler.LambdaLR(fresh_optim, lambda k: 1.0)  # adds initial_lr
        with pytest.raises(StateMismatchError, match="this optimizer has the hyperparameter "
                                                     "'initial_lr' and the checkpoint has not"):
            ckpt.load({"app": kind(fresh, fresh_optim)}, where, 1)
    # Parameters the checkpoint holds in two groups with different values, one group here
    # (flattened too: DCP would give the group its first parameter's values, silently).
    fresh = _mlp(1, 2)
    one_group = _O.AdamW(fresh.parameters(), lr=1e-2)
    for where, kind in ((root, ModelState), (flat_root, _Stage)):
        with pytest.raises(StateMismatchError, match=r"in one param group here \(param group "
                                                     r"0 \(first parameter 0.weight\)\): "
                                                     r"'weight_decay' is 0.01 in groups.0."
                                                     r"weight.hyper and 0.0 in groups.0.bias."
                                                     r"hyper"):
            ckpt.load({"app": kind(fresh, one_group)}, where, 1)
    # load_latest raises it as it raises any state mismatch: an older step would not fit.
    with pytest.raises(StateMismatchError, match="in one param group here"):
        ckpt.load_latest({"app": ModelState(fresh, one_group)}, root)


def test_a_refused_optimizer_load_leaves_model_and_optimizer_as_they_were(tmp_path):
    """The groups are checked on what was read, before anything is applied: a refused load
    copied no tensor into the model or the optimizer (it copied them all, then refused)."""
    for kind in (ModelState, _Stage):
        root = str(tmp_path / kind.__name__)
        model = _mlp(0, 2)
        optim = _adamw(model)
        _train(model, optim, 2)
        ckpt.save({"app": kind(model, optim)}, root, 2)
        fresh = _mlp(1, 2)
        fresh_optim = _adamw(fresh)
        _train(fresh, fresh_optim, 1, seed=30)
        torch.optim.lr_scheduler.LambdaLR(fresh_optim, lambda k: 1.0)  # adds initial_lr
        before = copy.deepcopy((fresh.state_dict(), fresh_optim.state_dict()))
        for load in (lambda s: ckpt.load(s, root, 2), lambda s: ckpt.load_latest(s, root)):
            with pytest.raises(StateMismatchError, match="'initial_lr'"):
                load({"app": kind(fresh, fresh_optim)})
            assert_same(before, (fresh.state_dict(), fresh_optim.state_dict()), kind.__name__)


def _old_packed(state: dict) -> dict:
    """``state`` as packed before groups had an index: ``hyper`` a 1-tuple."""
    groups = state["optim"]["groups"]
    for entry in groups.values():
        entry["hyper"] = (entry["hyper"][0],)
    return state


class _OldPacked(ModelState):
    def state_dict(self):
        return _old_packed(super().state_dict())


def test_checkpoints_packed_before_groups_had_an_index_still_load(tmp_path):
    root = str(tmp_path / "root")
    model = _mlp(0, 3)
    optim = _adamw(model)
    _train(model, optim, 3)
    ckpt.save({"app": _OldPacked(model, optim)}, root, 3)
    (entry,) = [v for k, v in consolidate(root, 3)[0]["app"]["optim"]["groups"]
                .items() if k == "0.weight"]
    assert len(entry["hyper"]) == 1
    fresh = _mlp(1, 3)
    fresh_optim = _adamw(fresh, lr=0.5)
    ckpt.load({"app": ModelState(fresh, fresh_optim)}, root, 3)
    assert_same(_full(model, optim), _full(fresh, fresh_optim))
    _train(model, optim, 2, seed=50)
    _train(fresh, fresh_optim, 2, seed=50)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_a_packed_entry_of_no_known_form_is_refused_naming_its_key():
    model = _mlp(0, 1)
    optim = _adamw(model)
    packed = ModelState(model, optim).state_dict()["optim"]
    packed["groups"]["0.weight"]["hyper"] = ({"lr": 0.1}, 0, "third")
    with pytest.raises(CorruptCheckpointError, match="optimizer param group "
                                                     "groups.0.weight.hyper holds"):
        unpack_optimizer_state(packed)
