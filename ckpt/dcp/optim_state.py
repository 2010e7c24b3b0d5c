"""An optimizer's state dict with its replicated values saved once per param group.

``torch.distributed.checkpoint.state_dict`` gives an optimizer's state with one
``step`` counter per parameter and, flattened (``flatten_optimizer_state_dict``, as the
trainer saves it), every hyperparameter once per parameter (``param_groups.<fqn>.lr``, ...);
unflattened, once per group (``param_groups.<i>.lr``). Every rank that holds the parameter
holds them all alike, so each was a write item per rank per save that the coordinator then
deduplicated: 13 of a parameter's 16 items under AdamW. Packed, a rank saves its shards
plus a constant:

* ``groups``: one entry per group, keyed by the group's first parameter name (the key is
  the same on every rank of a pipeline stage and differs between stages, whose groups
  differ): ``hyper``, the pair (the group's hyperparameters with its ``params``, the
  parameter names; the group's index in its optimizer, or None), one value; ``steps``,
  the group's step counters, one tensor (a counter per parameter, in ``params`` order),
  when every parameter of the group has a tensor counter of one dtype and device (else the
  counters stay per parameter, ``state.<fqn>.step``). One tensor whatever the values:
  counters that differ (a parameter skipped by some steps) change no key, so they neither
  plan a save again nor change what a load asks for.
* everything else (the per-parameter moments, which are the shards) as before.

What a group is depends on the form. Unflattened, the state dict holds the optimizer's
param groups: an entry is one of them, with its index. Flattened, it holds
hyperparameters per parameter and no groups (``set_optimizer_state_dict`` gives each of the
optimizer's groups the values of its first parameter): an entry is the parameters whose
values are equal, index None, and loading gives every parameter its own values back,
whatever the groups of the optimizer loaded into.

Loading takes any form: this layout's packing, another layout's (another pipeline split:
other groups, found by their ``params``), packing written before groups had an index
(``hyper`` a 1-tuple), or the expanded one of checkpoints written before packing.
:class:`PackedGroups` is a :class:`ckpt.dcp.planners.PackedNode`: before the load is
planned it asks for the keys the checkpoint has (``match_checkpoint``), and
:func:`unpack_optimizer_state` rebuilds the form the optimizer's ``set_*_state_dict`` wants,
each step counter a tensor of its own with the dtype and device the optimizer had. A
checkpoint that does not fit the optimizer (a parameter without hyperparameters, a
hyperparameter one side has and the other has not, one group here holding parameters the
checkpoint gives different values) is a :class:`ckpt.errors.StateMismatchError` naming the
group and the key. :func:`saved_groups` reads the groups of any form (for an export into
torch's own form: :func:`ckpt.export.to_torch_optimizer_state`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckpt.dcp.planners import PackedNode, placeholder
from ckpt.errors import CorruptCheckpointError, StateMismatchError

__all__ = ["PackedGroups", "LiveGroup", "SavedGroup", "pack_optimizer_state",
           "unpack_optimizer_state", "saved_groups", "GROUPS"]

GROUPS = "groups"  # the packed node's key in an optimizer state dict
_HYPER, _STEPS, _STEP, _PARAMS = "hyper", "steps", "step", "params"
_PG, _STATE = "param_groups", "state"


class LiveGroup(NamedTuple):
    """A group of the optimizer a state dict was packed from (see the module docstring for
    what a group is in each form)."""

    params: tuple[str, ...]  # parameter names, in the group's order
    step: Any  # a step counter of the optimizer's (dtype and device to restore), or None
    names: frozenset[str]  # the group's hyperparameter names
    index: int | None  # the group's index in its optimizer; None: flattened, no groups


class SavedGroup(NamedTuple):
    """A group of an optimizer state read from a checkpoint (:func:`saved_groups`)."""

    params: tuple[str, ...]  # parameter names, in the group's order
    hyper: dict[str, Any]  # its hyperparameters, without ``params``
    index: int | None  # its index in its optimizer; None: not known (flattened, or older)
    steps: Any  # the group's step counters (one tensor, in ``params`` order), or None
    key: str  # where it is in the optimizer state dict, for messages


class PackedGroups(PackedNode):
    """An optimizer state's param groups, packed (see the module docstring).

    ``members``: the groups packed (:class:`LiveGroup`), which :func:`unpack_optimizer_state`
    rebuilds; ``nested``: whether the optimizer state dict is the unflattened one
    (``state``/``param_groups``)."""

    def __init__(self, entries: dict[str, dict], members: list[LiveGroup], nested: bool):
        super().__init__(entries)
        self.members = members
        self.nested = nested

    def match_checkpoint(self, path: tuple, state_dict: dict, metadata: Metadata) -> None:
        """Ask for the checkpoint's keys of these values when it holds another form: its
        ``groups`` entries (all of them: another layout's groups are few), or the expanded
        keys of this rank's parameters."""
        saved = metadata.state_dict_metadata
        parent, n = path[:-1], len(path)
        mine = {f for group in self.members for f in group.params}
        own = {".".join(map(str, path + (first, sub))): value for first, entry in self.items()
               for sub, value in entry.items()}
        in_node, expanded = [], []
        for key, p in (metadata.planner_data or {}).items():
            p = tuple(p)
            if key not in saved:
                continue
            if p[:n] == path:
                in_node.append((key, p))
            elif p[:len(parent)] == parent and _is_expanded(p[len(parent):], mine) and \
                    _absent(state_dict, p):
                expanded.append((key, p))
        if not in_node and not expanded:
            return  # neither form: the load reports these keys missing
        if not expanded and {key for key, _ in in_node} == set(own) and all(
                _same_tensor(value, saved[key]) for key, value in own.items()):
            return  # this very form (a group's counters: as many as here)
        self.clear()
        for key, p in in_node:
            set_element(self, p[n:], placeholder(saved[key]))
        for key, p in expanded:
            set_element(state_dict, p, placeholder(saved[key]))


def _is_expanded(rel: tuple, mine: set[str]) -> bool:
    """Whether a checkpoint path (relative to the optimizer state dict) is one of the
    expanded form's: a param group's value or a parameter's step counter."""
    if not rel:
        return False
    if rel[0] == _PG:  # unflattened: param_groups.<i>.<name>
        return True
    if len(rel) == 3 and rel[0] == _STATE and rel[2] == _STEP:  # state.<fqn>.step
        return rel[1] in mine
    if len(rel) == 1 and isinstance(rel[0], str):  # flattened
        key = rel[0]
        if key.startswith(_PG + "."):
            return key[len(_PG) + 1:].rpartition(".")[0] in mine
        if key.startswith(_STATE + ".") and key.endswith("." + _STEP):
            return key[len(_STATE) + 1:-len(_STEP) - 1] in mine
    return False


def _same_tensor(value: Any, md: Any) -> bool:
    """A tensor of the state and a checkpoint value agree in shape and dtype (anything
    else: True, the load checks it)."""
    if not isinstance(value, torch.Tensor) or not isinstance(md, TensorStorageMetadata):
        return True
    return tuple(value.shape) == tuple(md.size) and value.dtype == md.properties.dtype


def _absent(state_dict: dict, path: tuple) -> bool:
    node: Any = state_dict
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return True
        node = node[part]
    return False


def pack_optimizer_state(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` (from ``get_state_dict``/``get_optimizer_state_dict``, unflattened or
    flattened) with its param groups packed. Returned unchanged when it cannot be packed
    safely (an empty group, a hyperparameter that is a tensor, a ``groups`` key of its own)."""
    nested = isinstance(osd.get(_PG), list) and isinstance(osd.get(_STATE), dict)
    if GROUPS in osd:
        return osd
    if nested:
        groups = [([str(f) for f in g[_PARAMS]], {k: v for k, v in g.items() if k != _PARAMS},
                   i) for i, g in enumerate(osd[_PG])]

        def step_of(fqn: str) -> Any:
            return osd[_STATE].get(fqn, {}).get(_STEP)
    else:
        per_param: dict[str, dict[str, Any]] = {}
        for key, value in osd.items():
            if key.startswith(_PG + "."):
                fqn, _, name = key[len(_PG) + 1:].rpartition(".")
                per_param.setdefault(fqn, {})[name] = value
        groups = []  # parameters with equal hyperparameters, in order of appearance
        for fqn, hyper in per_param.items():
            same = next((g for g in groups if g[1] == hyper), None)
            if same is None:
                groups.append(([fqn], hyper, None))
            else:
                same[0].append(fqn)

        def step_of(fqn: str) -> Any:
            return osd.get(f"{_STATE}.{fqn}.{_STEP}")
    if not groups or any(not fqns for fqns, _, _ in groups) or any(
            isinstance(v, torch.Tensor) for _, hyper, _ in groups for v in hyper.values()):
        return osd
    entries: dict[str, dict] = {}
    members = []
    packed_steps: set[str] = set()
    for fqns, hyper, index in groups:
        steps = [step_of(f) for f in fqns]
        template = next((s for s in steps if isinstance(s, torch.Tensor)), None)
        entry: dict[str, Any] = {_HYPER: ({**hyper, _PARAMS: list(fqns)}, index)}
        if _stackable(steps):
            entry[_STEPS] = torch.stack([s.detach() for s in steps])
            packed_steps.update(fqns)
        entries[fqns[0]] = entry
        members.append(LiveGroup(tuple(fqns), template, frozenset(hyper), index))
    if nested:
        out = {k: v for k, v in osd.items() if k != _PG}
        out[_STATE] = {fqn: ({k: v for k, v in st.items() if k != _STEP}
                             if fqn in packed_steps else st)
                       for fqn, st in osd[_STATE].items()}
    else:
        dropped = {f"{_STATE}.{f}.{_STEP}" for f in packed_steps}
        out = {k: v for k, v in osd.items()
               if not k.startswith(_PG + ".") and k not in dropped}
    out[GROUPS] = PackedGroups(entries, members, nested)
    return out


def _stackable(steps: list[Any]) -> bool:
    """Every step a 0-d tensor, of one dtype and device."""
    first = steps[0]
    return all(isinstance(s, torch.Tensor) and s.dim() == 0 and s.dtype == first.dtype
               and s.device == first.device for s in steps)


def saved_groups(osd: dict[str, Any]) -> list[SavedGroup]:
    """The param groups of an optimizer state dict as a checkpoint holds it, in any form:
    packed (``groups``; each with its index, or None where it has none), unflattened
    (``param_groups``, a list, or a dict by index as a load builds it) or flattened
    (``param_groups.<fqn>.<name>``: a group per parameter, index None). Raises
    ``CorruptCheckpointError`` naming the key of a packed entry that is none of the
    forms written."""
    out = []
    for first, entry in (osd.get(GROUPS) or {}).items():
        key = f"{GROUPS}.{first}.{_HYPER}"
        value = entry.get(_HYPER) if isinstance(entry, dict) else None
        # (group,): packed before groups had an index; (group, index) since.
        if not (isinstance(value, (tuple, list)) and len(value) in (1, 2)
                and isinstance(value[0], dict) and isinstance(value[0].get(_PARAMS), list)
                and (len(value) == 1 or value[1] is None or isinstance(value[1], int))):
            raise CorruptCheckpointError(
                f"optimizer param group {key} holds {str(value)[:120]}, not (hyperparameters "
                f"with 'params', group index); the checkpoint is damaged or from another "
                f"writer: load an earlier step", path=key)
        hyper = dict(value[0])
        params = tuple(str(f) for f in hyper.pop(_PARAMS))
        out.append(SavedGroup(params, hyper, value[1] if len(value) == 2 else None,
                              entry.get(_STEPS), key))
    groups = osd.get(_PG)  # the expanded form (checkpoints written before packing)
    items = groups.items() if isinstance(groups, dict) else enumerate(groups or ())
    for index, group in items:
        hyper = dict(group)
        params = tuple(str(f) for f in hyper.pop(_PARAMS, ()))
        out.append(SavedGroup(params, hyper, int(index), None, f"{_PG}.{index}"))
    flat: dict[str, dict] = {}
    for key, value in osd.items():
        if isinstance(key, str) and key.startswith(_PG + "."):
            fqn, _, name = key[len(_PG) + 1:].rpartition(".")
            flat.setdefault(fqn, {})[name] = value
    out.extend(SavedGroup((fqn,), hyper, None, None, f"{_PG}.{fqn}")
               for fqn, hyper in flat.items())
    return out


def unpack_optimizer_state(loaded: dict[str, Any]) -> dict[str, Any]:
    """The loaded form of :func:`pack_optimizer_state`'s result back in the optimizer's
    form (unflattened or flattened, as packed), whichever form the checkpoint held.
    ``loaded`` not packed: returned as is. Raises ``StateMismatchError`` (naming the group
    and the key) when the checkpoint has no hyperparameters for a parameter, when its
    hyperparameter names differ from the optimizer's, or (unflattened) when it gives the
    parameters of one of this optimizer's groups different values."""
    node = loaded.get(GROUPS)
    if not isinstance(node, PackedGroups):
        return loaded
    by_param: dict[str, SavedGroup] = {}
    steps: dict[str, Any] = {}
    for group in saved_groups(loaded):
        for i, fqn in enumerate(group.params):
            by_param[fqn] = group
            if group.steps is not None:
                steps[fqn] = group.steps[i]
    state = ({fqn: dict(st) for fqn, st in loaded.get(_STATE, {}).items()}
             if node.nested else None)
    out = {k: v for k, v in loaded.items()
           if k != GROUPS and k != _PG and not (isinstance(k, str) and k.startswith(_PG + "."))}
    param_groups = []
    for live in node.members:
        hyper = _group_hyper(live, by_param, node.nested)
        for fqn in live.params:
            step = steps.get(fqn)
            if node.nested:
                step = state.get(fqn, {}).get(_STEP) if step is None else step
                if step is not None:
                    state.setdefault(fqn, {})[_STEP] = _counter(step, live.step)
            else:
                key = f"{_STATE}.{fqn}.{_STEP}"
                step = loaded.get(key) if step is None else step
                if step is not None:
                    out[key] = _counter(step, live.step)
                for name, value in by_param[fqn].hyper.items():  # each its own values
                    out[f"{_PG}.{fqn}.{name}"] = value
        param_groups.append({**hyper, _PARAMS: list(live.params)})
    if node.nested:
        out[_STATE] = state
        out[_PG] = param_groups
    return out


def _group_hyper(live: LiveGroup, by_param: dict[str, SavedGroup], nested: bool) -> dict:
    """The checkpoint's hyperparameters for the optimizer group ``live``, checked."""
    first = live.params[0]
    what = (f"param group {live.index} (first parameter {first})" if live.index is not None
            else f"parameter {first}")
    missing = [f for f in live.params if f not in by_param]
    if missing:
        raise StateMismatchError(
            f"the checkpoint holds no optimizer hyperparameters for parameter(s) "
            f"{', '.join(missing[:10])} ({what}): it was saved without them or for another "
            f"model; load with the optimizer it was saved with", missing=missing)
    for fqn in live.params:
        saved = by_param[fqn]
        extra, lacking = set(saved.hyper) - live.names, live.names - set(saved.hyper)
        if extra or lacking:
            name = sorted(extra or lacking)[0]
            has, has_not = ("the checkpoint", "this optimizer") if extra else \
                ("this optimizer", "the checkpoint")
            raise StateMismatchError(
                f"{what}: {has} has the hyperparameter {name!r} and {has_not} has not "
                f"(checkpoint group {saved.key}); it was saved from another optimizer class, "
                f"torch version or LR scheduler: build the optimizer (and its scheduler) as "
                f"when it was saved", mismatched=[f"{saved.key}.{name}"])
    hyper = by_param[first].hyper
    for fqn in live.params[1:] if nested else ():
        other = by_param[fqn].hyper
        if other != hyper:
            name = next(k for k in sorted(hyper) if hyper[k] != other[k])
            raise StateMismatchError(
                f"the checkpoint holds different optimizer hyperparameters for {first} and "
                f"{fqn}, which are in one param group here ({what}): {name!r} is "
                f"{hyper[name]!r} in {by_param[first].key} and {other[name]!r} in "
                f"{by_param[fqn].key}; build the optimizer's param groups as when it was saved",
                mismatched=[f"{by_param[fqn].key}.{name}"])
    return dict(hyper)


def _counter(step: Any, template: Any) -> Any:
    """A parameter's own step counter: a copy of ``step`` with the optimizer's dtype and
    device (one tensor per parameter: optimizers increment them in place)."""
    if not isinstance(step, torch.Tensor):
        return step
    if isinstance(template, torch.Tensor):
        return step.to(device=template.device, dtype=template.dtype, copy=True)
    return step.clone()
