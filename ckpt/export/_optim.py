"""An exported optimizer state in torch's own form, for ``optimizer.load_state_dict``.

A checkpoint holds an optimizer's state by parameter name, its param groups packed
(:mod:`ckpt.dcp.optim_state`), so that it loads under any layout. A consolidated or
exported one (``consolidate(root)[0]["app"]["optim"]``, or the same key of a ``.pt``
export) is that form; :func:`to_torch_optimizer_state` turns it into what
``torch.optim.Optimizer.state_dict()`` returns: ``state`` keyed by parameter index,
``param_groups`` with their ``params`` as index lists, so a plain optimizer in one process
(``torch.optim.AdamW(model.parameters())``) takes it with ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ckpt.dcp import saved_groups
from ckpt.errors import StateMismatchError

__all__ = ["to_torch_optimizer_state"]

_STATE, _PG, _STEP, _PARAMS = "state", "param_groups", "step", "params"


def to_torch_optimizer_state(optim_state: dict[str, Any],
                             param_groups: Sequence[Sequence[str]] | None = None
                             ) -> dict[str, Any]:
    """``optim_state`` (an optimizer's state as exported: packed or expanded, unflattened as
    ``ModelState`` saves it or flattened as the trainer does) as torch's optimizer state
    dict: ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``.

    ``param_groups``: the parameter names of each group of the optimizer it will load into,
    in that optimizer's order (``ckpt.dcp.param_group_names(model, optimizer)``); indices
    number them in that order, as torch does. Default: the groups the checkpoint holds, in
    their optimizer's order, which their indices give (flattened checkpoints packed before
    groups had one know it only when all its parameters have equal hyperparameters: one
    group). ``ValueError`` when the order is not known (pass
    ``param_groups``), a name has no state in the checkpoint, or one group here holds
    parameters the checkpoint gives different hyperparameters (``StateMismatchError``,
    naming the group and the key). Tensors are the exported ones, not copies; step
    counters are tensors of their own (optimizers increment them in place).
    """
    groups = saved_groups(optim_state)
    if not groups:
        raise ValueError(f"the value given holds no optimizer param groups (keys: "
                         f"{', '.join(map(str, list(optim_state)[:8]))}); pass an optimizer's "
                         f"exported state, e.g. the .pt export's ['app']['optim']")
    by_param = {f: (g, i) for g in groups for i, f in enumerate(g.params)}
    if param_groups is None:
        param_groups = _checkpoint_order(groups)
    elif isinstance(param_groups, (str, bytes)) or any(
            isinstance(g, (str, bytes)) for g in param_groups):
        raise ValueError("param_groups: give a list of parameter-name lists, one per param "
                         "group, e.g. [[name for name, _ in model.named_parameters()]]")
    per_param = _per_param_state(optim_state, set(by_param))
    state: dict[int, dict[str, Any]] = {}
    out_groups = []
    index = 0
    for gi, names in enumerate(param_groups):
        names = [str(n) for n in names]
        unknown = [n for n in names if n not in by_param]
        if unknown:
            raise ValueError(f"param_groups[{gi}]: the checkpoint's optimizer state has no "
                             f"parameter {', '.join(unknown[:5])}; its parameters are "
                             f"{', '.join(list(by_param)[:8])}{' ...' if len(by_param) > 8 else ''}")
        if not names:
            raise ValueError(f"param_groups[{gi}] is empty; list the group's parameter names")
        hyper = _common_hyper(gi, names, by_param)
        ids = []
        for name in names:
            saved, i = by_param[name]
            entry = dict(per_param.get(name, {}))
            if saved.steps is not None:
                entry[_STEP] = saved.steps[i].clone()
            elif isinstance(entry.get(_STEP), torch.Tensor):
                entry[_STEP] = entry[_STEP].clone()
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        out_groups.append({**hyper, _PARAMS: ids})
    return {_STATE: state, _PG: out_groups}


def _checkpoint_order(groups: list) -> list[list[str]]:
    """The checkpoint's groups in their optimizer's order, when it is known."""
    if len(groups) == 1:
        return [list(groups[0].params)]
    indices = [g.index for g in groups]
    if None in indices or len(set(indices)) != len(indices):
        why = ("its groups have no index (packed before groups had one; flattened, one group "
               "per set of equal hyperparameters)" if None in indices
               else "two of its groups have one index (the groups of several optimizers, "
                    "e.g. pipeline stages)")
        raise ValueError(f"the optimizer state holds {len(groups)} param groups in no known "
                         f"order: {why}; pass param_groups=[[parameter names of group 0], "
                         f"...] in the order of the optimizer it will load into")
    return [list(g.params) for g in sorted(groups, key=lambda g: g.index)]


def _common_hyper(gi: int, names: list[str], by_param: dict) -> dict[str, Any]:
    first, _ = by_param[names[0]]
    for name in names[1:]:
        other, _ = by_param[name]
        if other is not first and other.hyper != first.hyper:
            keys = sorted(set(first.hyper) | set(other.hyper))
            key = next(k for k in keys if first.hyper.get(k, None) != other.hyper.get(k, None)
                       or (k in first.hyper) != (k in other.hyper))
            raise StateMismatchError(
                f"param_groups[{gi}] holds {names[0]} and {name}, whose hyperparameters differ "
                f"in the checkpoint: {key!r} is {first.hyper.get(key, '<absent>')!r} in "
                f"{first.key} and {other.hyper.get(key, '<absent>')!r} in {other.key}; "
                f"group the parameters as the optimizer that saved them did",
                mismatched=[f"{other.key}.{key}"])
    return dict(first.hyper)


def _per_param_state(optim_state: dict[str, Any], params: set[str]) -> dict[str, dict]:
    """Each parameter's state entries (moments, and ``step`` where it is not packed), from
    ``state[fqn][key]`` (unflattened) or ``"state.<fqn>.<key>"`` (flattened)."""
    nested = optim_state.get(_STATE)
    if isinstance(nested, dict):
        return {str(f): dict(v) for f, v in nested.items() if isinstance(v, dict)}
    out: dict[str, dict] = {}
    prefix = _STATE + "."
    for key, value in optim_state.items():
        if not (isinstance(key, str) and key.startswith(prefix)):
            continue
        rest = key[len(prefix):]
        # The longest parameter name the key starts with (names hold dots too).
        cut = rest.rfind(".")
        while cut > 0 and rest[:cut] not in params:
            cut = rest.rfind(".", 0, cut)
        fqn = rest[:cut] if cut > 0 else None
        if fqn is None:
            raise ValueError(f"optimizer state key {key!r} names no parameter of the "
                             f"checkpoint's param groups; the state is incomplete or not an "
                             f"optimizer's")
        out.setdefault(fqn, {})[rest[len(fqn) + 1:]] = value
    return out
