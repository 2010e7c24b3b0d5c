"""Checkpointing never changes training: for every optimizer of ``torch.optim`` (with and
without weight decay and momentum, and their amsgrad, maximize, dampening, nesterov,
centered, foreach and fused variants), the parameters and the optimizer's state after N
steps are bit-identical

* without any checkpoint;
* after ``init_optimizer_state``;
* with a manager saving before every step, the run resumed in the middle into a fresh
  model and optimizer (``load_latest``), in ``ModelState``'s form and in the trainer's
  flattened one;
* rolled back, after steps of its own, to the save made before the first step;

and the optimizer's step hooks run once per real step, never for a save or a load.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
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

pytestmark = pytest.mark.timeout(120)

_O = torch.optim
_STEPS = 4
_RESUME_AT = 2  # the checkpointed run goes on in a fresh model and optimizer from here


class _Flat:
    """Model and optimizer state in the trainer's form: flattened (keys by parameter name),
    the optimizer's param groups packed with their names."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self):
        init_optimizer_state(self.optim)
        model_sd = get_model_state_dict(self.model)
        osd = get_optimizer_state_dict(self.model, self.optim, options=self.options)
        return {"model": model_sd, "optim": pack_optimizer_state(
            osd, groups=[param_group_names(self.model, self.optim)], params=model_sd)}

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd["model"])
        set_optimizer_state_dict(self.model, self.optim, unpack_optimizer_state(sd["optim"]),
                                 options=self.options)


def _two_groups(model) -> list[dict]:
    """The two layers as two param groups with equal values (a packing by equal values
    would merge them)."""
    return [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}]


def _weights(model) -> list[dict]:  # Muon takes 2-d parameters only
    return [{"params": [model[0].weight]}, {"params": [model[1].weight]}]


_OPTIMIZERS = {
    "SGD": lambda m: _O.SGD(_two_groups(m), lr=0.1),
    "SGD-wd-maximize": lambda m: _O.SGD(_two_groups(m), lr=0.1, weight_decay=0.1,
                                        maximize=True),
    "SGD-momentum": lambda m: _O.SGD(_two_groups(m), lr=0.1, momentum=0.9),
    "SGD-momentum-wd-nesterov": lambda m: _O.SGD(_two_groups(m), lr=0.1, momentum=0.9,
                                                 weight_decay=0.1, nesterov=True),
    "SGD-momentum-dampening": lambda m: _O.SGD(_two_groups(m), lr=0.1, momentum=0.9,
                                               dampening=0.5),
    "SGD-momentum-wd-dampening-foreach": lambda m: _O.SGD(
        _two_groups(m), lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1, foreach=True),
    "SGD-momentum-wd-dampening-fused": lambda m: _O.SGD(
        _two_groups(m), lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1, fused=True),
    "SGD-momentum-wd-foreach": lambda m: _O.SGD(_two_groups(m), lr=0.1, momentum=0.9,
                                                weight_decay=0.1, foreach=True),
    "SGD-momentum-wd-fused": lambda m: _O.SGD(_two_groups(m), lr=0.1, momentum=0.9,
                                              weight_decay=0.1, fused=True),
    "Adam": lambda m: _O.Adam(_two_groups(m), lr=1e-2),
    "Adam-wd": lambda m: _O.Adam(_two_groups(m), lr=1e-2, weight_decay=0.1),
    "Adam-wd-amsgrad-maximize-foreach": lambda m: _O.Adam(
        _two_groups(m), lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, foreach=True),
    "Adam-wd-fused": lambda m: _O.Adam(_two_groups(m), lr=1e-2, weight_decay=0.1, fused=True),
    "Adam-tensor-lr": lambda m: _O.Adam(_two_groups(m), lr=torch.tensor(1e-2),
                                        weight_decay=0.1),
    "AdamW-no-wd": lambda m: _O.AdamW(_two_groups(m), lr=1e-2, weight_decay=0.0),
    "AdamW-wd-amsgrad": lambda m: _O.AdamW(_two_groups(m), lr=1e-2, weight_decay=0.1,
                                           amsgrad=True),
    "Adamax": lambda m: _O.Adamax(_two_groups(m), lr=1e-2),
    "Adamax-wd-foreach": lambda m: _O.Adamax(_two_groups(m), lr=1e-2, weight_decay=0.1,
                                             foreach=True),
    "NAdam": lambda m: _O.NAdam(_two_groups(m), lr=1e-2),
    "NAdam-wd": lambda m: _O.NAdam(_two_groups(m), lr=1e-2, weight_decay=0.1),
    "NAdam-decoupled-foreach": lambda m: _O.NAdam(_two_groups(m), lr=1e-2, weight_decay=0.1,
                                                  foreach=True, decoupled_weight_decay=True),
    "RAdam": lambda m: _O.RAdam(_two_groups(m), lr=1e-2),
    "RAdam-wd": lambda m: _O.RAdam(_two_groups(m), lr=1e-2, weight_decay=0.1),
    "RAdam-decoupled-foreach": lambda m: _O.RAdam(_two_groups(m), lr=1e-2, weight_decay=0.1,
                                                  foreach=True, decoupled_weight_decay=True),
    "Adagrad": lambda m: _O.Adagrad(_two_groups(m), lr=1e-2),
    "Adagrad-wd-initial-decay": lambda m: _O.Adagrad(
        _two_groups(m), lr=1e-2, weight_decay=0.1, initial_accumulator_value=0.3,
        lr_decay=0.01),
    "Adagrad-wd-fused": lambda m: _O.Adagrad(_two_groups(m), lr=1e-2, weight_decay=0.1,
                                             fused=True),
    "Adadelta": lambda m: _O.Adadelta(_two_groups(m), lr=1.0),
    "Adadelta-wd-maximize-foreach": lambda m: _O.Adadelta(
        _two_groups(m), lr=1.0, weight_decay=0.1, maximize=True, foreach=True),
    "RMSprop": lambda m: _O.RMSprop(_two_groups(m), lr=1e-2),
    "RMSprop-wd": lambda m: _O.RMSprop(_two_groups(m), lr=1e-2, weight_decay=0.1),
    "RMSprop-momentum": lambda m: _O.RMSprop(_two_groups(m), lr=1e-2, momentum=0.9),
    "RMSprop-centered": lambda m: _O.RMSprop(_two_groups(m), lr=1e-2, centered=True),
    "RMSprop-momentum-centered-wd-foreach": lambda m: _O.RMSprop(
        _two_groups(m), lr=1e-2, weight_decay=0.1, momentum=0.9, centered=True, foreach=True),
    "Rprop": lambda m: _O.Rprop(_two_groups(m), lr=1e-2),
    "Rprop-maximize-foreach": lambda m: _O.Rprop(_two_groups(m), lr=1e-2, maximize=True,
                                                 foreach=True),
    "Rprop-lr-below-min-step": lambda m: _O.Rprop(_two_groups(m), lr=1e-7),
    "ASGD": lambda m: _O.ASGD(_two_groups(m), lr=1e-2, t0=1),
    "ASGD-wd-foreach": lambda m: _O.ASGD(_two_groups(m), lr=1e-2, weight_decay=0.1, t0=1,
                                         foreach=True),
    "Adafactor": lambda m: _O.Adafactor(_two_groups(m), lr=1e-2),
    "Adafactor-wd-foreach": lambda m: _O.Adafactor(_two_groups(m), lr=1e-2, weight_decay=0.1,
                                                   foreach=True),
    "Muon": lambda m: _O.Muon(_weights(m), lr=1e-2),
}
# SparseAdam is tested below on an embedding (it takes sparse gradients only). LBFGS is
# refused (below): its one state for all parameters, with lists of tensors, goes through
# neither of torch.distributed.checkpoint's optimizer state dicts.


class _Run:
    """A model, its optimizer and a count of the optimizer's step hooks."""

    def __init__(self, name: str, seed: int):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.optim = _OPTIMIZERS[name](self.model)
        self.hooks = [0, 0]
        self.optim.register_step_pre_hook(lambda *a: self._count(0))
        self.optim.register_step_post_hook(lambda *a: self._count(1))

    def _count(self, i: int) -> None:
        self.hooks[i] += 1

    def step(self, i: int) -> None:
        x = torch.ones(2, 4) * (i + 1) - 2.5
        self.model(x).square().sum().backward()
        self.optim.step()
        self.optim.zero_grad()

    def outcome(self) -> tuple[list[torch.Tensor], dict]:
        return ([p.detach().clone() for p in self.model.parameters()],
                self.optim.state_dict())


def _bits(v) -> torch.Tensor:
    t = torch.as_tensor(v)
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        x, y = _bits(a), _bits(b)
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    return a == b


def _assert_bit_equal(expected, actual, where: str) -> None:
    (params_a, sd_a), (params_b, sd_b) = expected, actual
    for i, (x, y) in enumerate(zip(params_a, params_b)):
        assert _same(x, y), f"{where}: parameter {i}, max |diff| {(x - y).abs().max()}"
    assert sd_a["param_groups"] == sd_b["param_groups"], where
    # An empty state is none (what init_optimizer_state gives a parameter whose state the
    # first step makes from the gradient, or an optimizer that keeps none).
    state_a, state_b = ({i: st for i, st in sd["state"].items() if st} for sd in (sd_a, sd_b))
    assert state_a.keys() == state_b.keys(), where
    for i, st in state_a.items():
        assert st.keys() == state_b[i].keys(), (where, i)
        for k, v in st.items():
            assert _same(v, state_b[i][k]), f"{where}: state {i}.{k}"


def _plain(name: str, init: bool = False):
    run = _Run(name, 0)
    if init:
        init_optimizer_state(run.optim)
    for i in range(_STEPS):
        run.step(i)
    assert run.hooks == [_STEPS, _STEPS], f"{name}: step hooks ran {run.hooks}"
    return run.outcome()


def _checkpointed(name: str, form, root: str):
    """Saved by a manager before every step; after the save at _RESUME_AT the run goes on
    in a fresh model and optimizer (another seed) that resume from it."""
    options = ckpt.ManagerOptions(async_save=False, use_lease=False)
    run = _Run(name, 0)
    hooks = 0
    with ckpt.CheckpointManager(root, options, retention=[]) as mgr:
        for i in range(_STEPS):
            mgr.save(i, {"app": form(run.model, run.optim)}, force=True)
            if i == _RESUME_AT:
                hooks += sum(run.hooks)
                run = _Run(name, 1)
                assert mgr.load_latest({"app": form(run.model, run.optim)}).step == i
            run.step(i)
    assert hooks + sum(run.hooks) == 2 * _STEPS, f"{name}: step hooks ran {hooks} + {run.hooks}"
    return run.outcome()


def _from_first_save(name: str, form, root: str):
    """A run that took steps of its own, rolled back to the save made before the first
    step (its optimizer's state then as that save's: none where it had none yet)."""
    run = _Run(name, 1)
    for i in range(2):
        run.step(10 + i)
    ckpt.load({"app": form(run.model, run.optim)}, root, 0)
    run.hooks = [0, 0]
    for i in range(_STEPS):
        run.step(i)
    assert run.hooks == [_STEPS, _STEPS], f"{name}: step hooks ran {run.hooks}"
    return run.outcome()


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_checkpointing_never_changes_training(name, tmp_path):
    plain = _plain(name)
    _assert_bit_equal(plain, _plain(name, init=True), f"{name}, init_optimizer_state")
    for form in (ModelState, _Flat):
        root = str(tmp_path / form.__name__)
        where = f"{name}, {form.__name__}"
        _assert_bit_equal(plain, _checkpointed(name, form, root),
                          f"{where}: saved before every step, resumed at {_RESUME_AT}")
    _assert_bit_equal(plain, _from_first_save(name, ModelState, str(tmp_path / "ModelState")),
                      f"{name}: rolled back to the save before the first step")


def test_sparse_adam_trains_alike_saved_and_resumed(tmp_path):
    def run(seed: int = 0):
        torch.manual_seed(seed)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        return emb, _O.SparseAdam(emb.parameters(), lr=1e-2)

    def step(emb, optim, i: int) -> None:
        emb(torch.tensor([1, 2, i])).sum().backward()
        optim.step()
        optim.zero_grad()

    emb, optim = run()
    for i in range(_STEPS):
        step(emb, optim, i)
    plain = emb.weight.detach().clone()
    emb, optim = run()
    init_optimizer_state(optim)
    assert optim.state[emb.weight]["step"] == 0
    for i in range(_STEPS):
        step(emb, optim, i)
    assert _same(plain, emb.weight.detach())
    root = str(tmp_path / "root")
    emb, optim = run()
    for i in range(_STEPS):
        ckpt.save({"app": ModelState(emb, optim)}, root, i, use_lease=False)
        if i == _RESUME_AT:
            emb, optim = run(1)
            ckpt.load({"app": ModelState(emb, optim)}, root, i)
        step(emb, optim, i)
    assert _same(plain, emb.weight.detach())


def test_lbfgs_is_refused_before_anything_changes(tmp_path):
    run = _Run("SGD", 0)
    optim = _O.LBFGS(run.model.parameters())
    before = [p.detach().clone() for p in run.model.parameters()]
    with pytest.raises(ValueError, match="LBFGS keeps one state for all its parameters"):
        init_optimizer_state(optim)
    with pytest.raises(ValueError, match="LBFGS keeps one state"):
        ckpt.save({"app": ModelState(run.model, optim)}, str(tmp_path / "root"), 0,
                  use_lease=False)
    assert not optim.state
    assert all(_same(a, p) for a, p in zip(before, run.model.parameters()))


def _fsdp_run(name: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    run = _Run(name, seed)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in run.model:
        fully_shard(layer, mesh=mesh)
    fully_shard(run.model, mesh=mesh)
    run.optim = _OPTIMIZERS[name](run.model)  # over the sharded parameters
    return run


def _fsdp_body(rank: int, world: int, root: str) -> None:
    """SGD's momentum buffer, which a fresh optimizer has not made yet, loads as a DTensor
    shard like its parameter (FSDP2), in both forms, and the run goes on bit for bit."""
    name = "SGD-momentum-wd-dampening-foreach"
    plain = _fsdp_run(name, 0)
    for i in range(_STEPS):
        plain.step(i)
    expected = [p.full_tensor() for p in plain.model.parameters()]
    for form in (ModelState, _Flat):
        run = _fsdp_run(name, 0)
        for i in range(_STEPS):
            if i == _RESUME_AT:
                ckpt.save({"app": form(run.model, run.optim)}, f"{root}/{form.__name__}", i)
                run = _fsdp_run(name, 1)
                ckpt.load({"app": form(run.model, run.optim)}, f"{root}/{form.__name__}", i)
                buf = run.optim.state[run.model[0].weight]["momentum_buffer"]
                assert type(buf) is type(run.model[0].weight), type(buf)  # a DTensor
            run.step(i)
        for i, (a, p) in enumerate(zip(expected, run.model.parameters())):
            assert _same(a, p.full_tensor()), f"{form.__name__}: parameter {i}"


def test_a_state_not_made_yet_loads_as_its_parameters_shard_under_fsdp2(tmp_path):
    from tests.dist import run_ranks

    run_ranks(_fsdp_body, 2, str(tmp_path), timeout=120)
