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

A group is the optimizer's group, with its index in its optimizer. Unflattened, the state
dict holds the optimizer's param groups; flattened, it holds hyperparameters per parameter
and no groups, so the packer is given the groups by name (:func:`param_group_names`, one
list per optimizer whose state the dict holds; ``ModelState`` and the trainer give them).
Packed flattened without them (and in checkpoints written before they were given), an
entry is the parameters whose values are equal (index None), each of which loads its own
values.

Loading takes any form: this layout's packing, another layout's (another pipeline split:
other groups, found by their ``params``), packing written before groups had an index
(``hyper`` a 1-tuple), or the expanded one of checkpoints written before packing.
:class:`PackedGroups` is a :class:`ckpt.dcp.planners.PackedNode`: before the load is
planned it asks for the keys the checkpoint has (``match_checkpoint``), and
:func:`unpack_optimizer_state` rebuilds the unflattened form (which
``set_optimizer_state_dict`` takes whatever its options), each step counter a tensor of
its own with the dtype and device the optimizer had. A parameter's state takes the
checkpoint's form where this optimizer has none yet (SGD's momentum buffer, made by the
first step: a fresh optimizer loads the checkpoint's), and a parameter the checkpoint holds
no state for (saved before its first step) loads with none. A checkpoint that does not fit
the optimizer (a parameter without hyperparameters, a hyperparameter one side has and the
other has not, one group here holding parameters the checkpoint gives different values) is
a :class:`ckpt.errors.StateMismatchError` naming the group and the key, raised before the
load applies anything (``check_loaded``), so the model and optimizer stay as they were.
:func:`saved_groups` reads the groups of any form (for an export into torch's own form:
:func:`ckpt.export.to_torch_optimizer_state`).

Size: one concept, the packed form: packing, matching a checkpoint's form, the check before
a load applies and unpacking read the same entries and paths; split, each form's rules
would be read in two places.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckpt.dcp.planners import PackedNode, placeholder
from ckpt.errors import CorruptCheckpointError, StateMismatchError

__all__ = ["PackedGroups", "LiveGroup", "SavedGroup", "pack_optimizer_state",
           "unpack_optimizer_state", "saved_groups", "param_group_names", "GROUPS"]

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
    (``state``/``param_groups``); ``params``: the model's tensors by parameter name, which
    shape a state value this optimizer has not made yet as its parameter (a DTensor shard
    under FSDP2), or None (whole tensors)."""

    def __init__(self, entries: dict[str, dict], members: list[LiveGroup], nested: bool,
                 params: Mapping[str, Any] | None = None):
        super().__init__(entries)
        self.members = members
        self.nested = nested
        self.params = params or {}

    def match_checkpoint(self, path: tuple, state_dict: dict, metadata: Metadata) -> None:
        """Ask for the checkpoint's keys of these values when it holds another form: its
        ``groups`` entries (all of them: another layout's groups are few), or the expanded
        keys of this rank's parameters; and for each parameter whose state this optimizer
        has not made yet, the state the checkpoint holds for it (or, where the checkpoint
        holds none for a parameter, none)."""
        saved = metadata.state_dict_metadata
        parent, n = path[:-1], len(path)
        mine = {f for group in self.members for f in group.params}
        own = {".".join(map(str, path + (first, sub))): value for first, entry in self.items()
               for sub, value in entry.items()}
        in_node, expanded = [], []
        state_paths: dict[str, list] = {}
        for key, p in (metadata.planner_data or {}).items():
            p = tuple(p)
            if key not in saved:
                continue
            if p[:n] == path:
                in_node.append((key, p))
            elif p[:len(parent)] == parent and _is_expanded(p[len(parent):], mine) and \
                    _absent(state_dict, p):
                expanded.append((key, p))
            elif p[:len(parent)] == parent:
                fqn = _state_param(p[len(parent):], mine)
                if fqn is not None:
                    state_paths.setdefault(fqn, []).append((key, p))
        self._match_state(parent, state_dict, state_paths, saved, mine)
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

    def _match_state(self, parent: tuple, state_dict: dict, state_paths: dict[str, list],
                     saved: dict, mine: set[str]) -> None:
        """A parameter with no state here takes the checkpoint's (placeholders at its
        paths); a parameter with state here and none in the checkpoint loads with none."""
        osd = _node_at(state_dict, parent)
        keys_here = _state_keys(osd, mine, self.nested)
        for fqn in sorted(mine):
            here, there = keys_here.get(fqn, []), state_paths.get(fqn, [])
            if here and not there:
                _drop_state(osd, fqn, here, self.nested)
            elif there and not here:
                if self.nested:  # a dict of the state's own, not the optimizer's
                    osd[_STATE] = states = osd.get(_STATE) or {}
                    states[fqn] = dict(states.get(fqn) or {})
                like = self.params.get(fqn)
                for key, p in there:
                    set_element(state_dict, p, placeholder(saved[key], like))

    def check_loaded(self, path: tuple, objects: dict[tuple, Any]) -> None:
        """Raise the ``StateMismatchError`` :func:`unpack_optimizer_state` would raise for
        the objects read (before the load applies anything)."""
        parent = path[:-1]
        view: dict[str, Any] = {}
        for p, value in objects.items():
            if p[:len(parent)] == parent and len(p) > len(parent):
                set_element(view, p[len(parent):], value)
        _fit(self, saved_groups(view))


def _node_at(state_dict: dict, path: tuple) -> dict:
    node: Any = state_dict
    for part in path:
        node = node[part]
    return node


def _state_param(rel: tuple, mine: set[str]) -> str | None:
    """The parameter a checkpoint path (relative to the optimizer state dict) holds state
    of, other than its step counter (the groups' business); None: none of ``mine``."""
    if len(rel) >= 3 and rel[0] == _STATE and rel[1] in mine:  # unflattened
        return rel[1] if rel[2:] != (_STEP,) else None
    if rel and isinstance(rel[0], str):  # flattened
        split = _split_state_key(rel[0], mine)
        if split is not None and (split[1] != [_STEP] or len(rel) > 1):
            return split[0]
    return None


def _split_state_key(key: str, mine: set[str]) -> tuple[str, list[str]] | None:
    """A flattened state key ``state.<fqn>.<name>[.<name> ...]`` as (fqn, names), the
    longest fqn of ``mine`` that fits; None: not one."""
    parts = key.split(".")
    if len(parts) < 3 or parts[0] != _STATE:
        return None
    for i in range(len(parts) - 1, 1, -1):
        fqn = ".".join(parts[1:i])
        if fqn in mine:
            return fqn, parts[i:]
    return None


def _state_keys(osd: dict, mine: set[str], nested: bool) -> dict[str, list[str]]:
    """The keys of each parameter's state in the state dict, but its step counter."""
    if nested:
        return {fqn: [k for k in st if k != _STEP]
                for fqn, st in (osd.get(_STATE) or {}).items() if fqn in mine}
    out: dict[str, list[str]] = {}
    for key in osd:
        split = _split_state_key(key, mine) if isinstance(key, str) else None
        if split is not None and split[1] != [_STEP]:
            out.setdefault(split[0], []).append(key)
    return out


def _drop_state(osd: dict, fqn: str, keys: list[str], nested: bool) -> None:
    """Leave ``fqn``'s state (but its step counter) out of what is loaded, in the state
    dict's own dicts only (never the optimizer's)."""
    if nested:
        st = osd[_STATE][fqn]
        osd[_STATE][fqn] = {k: v for k, v in st.items() if k == _STEP}
    else:
        for k in keys:
            del osd[k]


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


def param_group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                      ) -> list[list[str]]:
    """Each of ``optimizer``'s param groups as its parameters' names in ``model`` (the
    names ``get_optimizer_state_dict(model, optimizer)`` keys them by: ``model`` as given
    there, unwrapped), in the group's order: what :func:`pack_optimizer_state` takes for a
    flattened state dict. ``ValueError`` naming the group for a parameter ``model`` does
    not hold."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = []
    for index, group in enumerate(optimizer.param_groups):
        unknown = [i for i, p in enumerate(group[_PARAMS]) if id(p) not in names]
        if unknown:
            raise ValueError(f"param group {index} of the optimizer holds parameter(s) at "
                             f"position(s) {unknown[:5]} that the model does not; give the "
                             f"module whose parameters the optimizer steps")
        out.append([names[id(p)] for p in group[_PARAMS]])
    return out


def pack_optimizer_state(osd: dict[str, Any], *,
                         groups: Sequence[Sequence[Sequence[str]]] | None = None,
                         params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``osd`` (from ``get_state_dict``/``get_optimizer_state_dict``, unflattened or
    flattened) with its param groups packed. Returned unchanged when it cannot be packed
    safely (an empty group unflattened, a hyperparameter that is a tensor, a ``groups`` key
    of its own).

    ``groups``: for a flattened ``osd`` (which holds no groups), the param groups of each
    optimizer whose state it holds, by parameter name: ``[param_group_names(model,
    optimizer), ...]`` (each group packed with its index in its optimizer; ``ValueError``
    naming the parameter when they do not cover ``osd`` exactly). Without them the
    entries are the parameters whose values are equal (index None), and a load gives
    each parameter its own values, as DCP's flattened load does: nothing checks then that
    one group of the optimizer gets one set of values (``ModelState`` and the trainer
    give them).
    ``params``: the model's tensors by parameter name (its state dict): a state value the
    checkpoint holds and this optimizer has not made yet loads into one like its
    parameter (see the module docstring); without, into a whole tensor."""
    nested = isinstance(osd.get(_PG), list) and isinstance(osd.get(_STATE), dict)
    if GROUPS in osd:
        return osd
    if nested:
        packed_groups = [([str(f) for f in g[_PARAMS]],
                          {k: v for k, v in g.items() if k != _PARAMS}, i)
                         for i, g in enumerate(osd[_PG])]

        def step_of(fqn: str) -> Any:
            return osd[_STATE].get(fqn, {}).get(_STEP)
    else:
        packed_groups = _flat_groups(osd, groups)

        def step_of(fqn: str) -> Any:
            return osd.get(f"{_STATE}.{fqn}.{_STEP}")
    if not packed_groups or any(not fqns for fqns, _, _ in packed_groups) or any(
            isinstance(v, torch.Tensor) for _, hyper, _ in packed_groups
            for v in hyper.values()):
        return osd
    entries: dict[str, dict] = {}
    members = []
    packed_steps: set[str] = set()
    for fqns, hyper, index in packed_groups:
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
        # Dicts of the state's own (a load may reshape them), never the optimizer's.
        out[_STATE] = {fqn: {k: v for k, v in st.items()
                             if not (k == _STEP and fqn in packed_steps)}
                       for fqn, st in osd[_STATE].items()}
    else:
        dropped = {f"{_STATE}.{f}.{_STEP}" for f in packed_steps}
        out = {k: v for k, v in osd.items()
               if not k.startswith(_PG + ".") and k not in dropped}
    out[GROUPS] = PackedGroups(entries, members, nested, params)
    return out


def _flat_groups(osd: dict[str, Any], groups: Sequence[Sequence[Sequence[str]]] | None
                 ) -> list[tuple[list[str], dict, int | None]]:
    """A flattened state dict's groups: ``groups``' (see :func:`pack_optimizer_state`),
    each with its values and index, checked to cover the state dict's parameters; without
    ``groups``, the parameters whose values are equal (index None)."""
    per_param: dict[str, dict[str, Any]] = {}
    for key, value in osd.items():
        if key.startswith(_PG + "."):
            fqn, _, name = key[len(_PG) + 1:].rpartition(".")
            per_param.setdefault(fqn, {})[name] = value
    if not per_param:
        return []
    if groups is None:  # parameters with equal values, in order of appearance
        by_value: list[tuple[list[str], dict, None]] = []
        for fqn, hyper in per_param.items():
            same = next((g for g in by_value if g[1] == hyper), None)
            if same is None:
                by_value.append(([fqn], hyper, None))
            else:
                same[0].append(fqn)
        return by_value
    if isinstance(groups, (str, bytes)):
        raise ValueError("groups: give one list per optimizer of its param groups' parameter "
                         "names, e.g. [param_group_names(model, optimizer)]")
    out, seen = [], set()
    for optimizer_groups in groups:
        for index, names in enumerate(optimizer_groups):
            names = [str(n) for n in names]
            unknown = [n for n in names if n not in per_param]
            if unknown:
                raise ValueError(f"groups: parameter {unknown[0]} (param group {index}) has "
                                 f"no hyperparameters in the optimizer state dict (it holds "
                                 f"{', '.join(list(per_param)[:5])} ...); give the names "
                                 f"param_group_names(model, optimizer) gives for the model "
                                 f"the state dict was taken of")
            seen.update(names)
            if names:
                out.append((names, per_param[names[0]], index))
    left = [f for f in per_param if f not in seen]
    if left:
        raise ValueError(f"groups: parameter {left[0]} of the optimizer state dict is in no "
                         f"group given; give every optimizer's groups "
                         f"(param_group_names(model, optimizer) for each)")
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
    """The loaded form of :func:`pack_optimizer_state`'s result back in torch's unflattened
    form (``state``/``param_groups`` by parameter name, which ``set_optimizer_state_dict``
    takes whatever its ``flatten_optimizer_state_dict`` option; its ``param_groups`` the
    packed groups of every optimizer packed together), whichever form the checkpoint held.
    ``loaded`` not packed: returned as is. Raises ``StateMismatchError`` (naming the group
    and the key) when the checkpoint has no hyperparameters for a parameter, when its
    hyperparameter names differ from the optimizer's, or when it gives the parameters of
    one of this optimizer's groups different values."""
    node = loaded.get(GROUPS)
    if not isinstance(node, PackedGroups):
        return loaded
    saved = saved_groups(loaded)
    hypers = _fit(node, saved)
    hypers_of = {fqn: group for group in saved for fqn in group.params}
    steps: dict[str, Any] = {}
    for group in saved:
        if group.steps is not None:
            for i, fqn in enumerate(group.params):
                steps[fqn] = group.steps[i]
    mine = [fqn for live in node.members for fqn in live.params]
    if node.nested:
        state = {fqn: dict(st) for fqn, st in (loaded.get(_STATE) or {}).items()}
    else:
        state = _nested_state(loaded, mine)
    out = {k: v for k, v in loaded.items() if k not in (GROUPS, _PG, _STATE) and not (
        isinstance(k, str) and k.startswith((_PG + ".", _STATE + ".")))}
    param_groups = []
    for live, hyper in zip(node.members, hypers):
        for fqn in live.params:
            st = state.setdefault(fqn, {})  # none: loads with none (DCP asks each for one)
            step = steps.get(fqn, st.get(_STEP))
            if step is not None:
                st[_STEP] = _counter(step, live.step)
        if hyper is None:  # not the optimizer's groups: each parameter its own values
            param_groups.extend({**hypers_of[fqn].hyper, _PARAMS: [fqn]}
                                for fqn in live.params)
        else:
            param_groups.append({**hyper, _PARAMS: list(live.params)})
    out[_STATE] = state
    out[_PG] = param_groups
    return out


def _nested_state(loaded: dict[str, Any], mine: list[str]) -> dict[str, dict]:
    """The per-parameter state of a flattened state dict (``state.<fqn>.<key>``, a key
    dotted further for a nested value) as torch's unflattened ``state``. Rebuilt here, not
    by DCP's unflattening, which keeps only the keys the optimizer's own state has now
    (none before its first step)."""
    state: dict[str, dict] = {}
    names = set(mine)
    for key, value in loaded.items():
        split = _split_state_key(key, names) if isinstance(key, str) else None
        if split is None:
            continue
        fqn, (*path, last) = split
        node = state.setdefault(fqn, {})
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return state


def _fit(node: PackedGroups, saved: list[SavedGroup]) -> list[dict | None]:
    """The checkpoint's hyperparameters for each group of ``node``, checked (None for
    one that is not the optimizer's group: each of its parameters takes its own)."""
    by_param: dict[str, SavedGroup] = {}
    for group in saved:
        for fqn in group.params:
            by_param[fqn] = group
    return [_group_hyper(live, by_param) for live in node.members]


def _group_hyper(live: LiveGroup, by_param: dict[str, SavedGroup]) -> dict | None:
    """The checkpoint's hyperparameters for the optimizer group ``live``, checked (None:
    ``live`` is not a group, see :func:`_fit`)."""
    first = live.params[0]
    what = (f"param group {live.index} (first parameter {first})" if live.index is not None
            else f"the group of parameter {first}")
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
    if live.index is None:  # parameters with equal values packed, not a group
        return None
    hyper = by_param[first].hyper
    for fqn in live.params[1:]:
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
