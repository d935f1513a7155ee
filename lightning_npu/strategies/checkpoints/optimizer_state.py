"""An optimizer's state as checkpoints hold it: keyed by parameter name (what DCP and torch's state-dict API match) or
numbered as ``optimizer.state_dict()`` numbers it (what a plain optimizer loads), and in its full form.

The full form is the optimizer's own business: an optimizer whose live state is not laid out as torch's optimizers
lay theirs out (``lightning_npu.optim.AdamW8bit``: 8-bit codes and scales for its moments) defines
``to_full_state(state_dict)`` -- the state a full checkpoint holds, which a plain torch optimizer loads -- and
``from_full_state(state_dict)``, its inverse, applied before a full state is loaded into it. Other optimizers need
neither: their full state is their state dict.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_npu import compat


def to_full_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """What a full checkpoint holds of ``optimizer``'s ``state_dict`` (the optimizer's ``to_full_state``, if any)."""
    convert = getattr(optimizer, "to_full_state", None)
    return state_dict if convert is None else convert(state_dict)


def from_full_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A full checkpoint's ``state_dict`` in the layout of ``optimizer``'s live state (its ``from_full_state``)."""
    convert = getattr(optimizer, "from_full_state", None)
    return state_dict if convert is None else convert(state_dict)


def keyed_by_name(optimizer_state: dict[str, Any], module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (what ``set_optimizer_state_dict`` takes), from one keyed by
    index (plain ``optimizer.state_dict()``) or by name. Works when the state is empty (an optimizer without state,
    such as SGD without momentum, before or after its first step)."""
    groups = optimizer_state.get("param_groups", [])
    ids = [p for group in groups for p in group.get("params", [])]
    if not ids or not isinstance(ids[0], int):
        return optimizer_state  # already keyed by name
    # The names DCP's state-dict API keys parameters by (a compiled submodule's `_orig_mod.` is not in them).
    name_of = {id(p): next(iter(compat.dcp_parameter_fqns(module, name))) for name, p in module.named_parameters()}
    live = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(live) != len(ids):
        raise ValueError(
            f"the checkpoint's optimizer state covers {len(ids)} parameters, the optimizer has {len(live)}: the"
            " checkpoint was written for another model or optimizer"
        )
    names = dict(zip(sorted(ids), live))
    return {
        "state": {names[index]: value for index, value in optimizer_state.get("state", {}).items()},
        "param_groups": [{**group, "params": [names[p] for p in group["params"]]} for group in groups],
    }


def whole_param_groups(optimizer_state: dict[str, Any], order: list[str], group: Any,
                       numbered: bool = False) -> dict[str, Any]:
    """``optimizer_state`` (keyed by name) with each param group listing the parameters it holds on every rank of
    ``group`` (a pipeline's, each rank holding other parameters; a collective), in the whole model's ``order``: what
    the group lists without pipeline parallelism. A sharded checkpoint keeps one copy of each group's list, and
    offline consolidation numbers the state by it. ``numbered``: for a full checkpoint, which numbers the state by
    these lists: a group not listed in the model's order is refused (ValueError, on every rank alike)."""
    import torch.distributed as dist

    local = [group_["params"] for group_ in optimizer_state.get("param_groups", [])]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    if len({len(lists) for lists in gathered}) != 1:
        raise ValueError(f"the pipeline's ranks hold {sorted({len(lists) for lists in gathered})} param groups:"
                         " every rank's optimizer must have the same groups (an empty one where a stage has none)")
    position = {name: i for i, name in enumerate(order)}
    for lists in gathered if numbered else ():
        for index, names in enumerate(lists):
            places = [position.get(name, len(order)) for name in names]
            late = next((k for k in range(1, len(places)) if places[k] < places[k - 1]), None)
            if late is not None:
                # A checkpoint numbers a group's parameters in the order the group lists them; a pipeline's ranks
                # hold parts of each list, which only the model's order can put back together.
                raise ValueError(
                    f"param group {index} lists {names[late]!r} after {names[late - 1]!r}, against the model's order:"
                    " under pipeline parallelism each group's parameters are numbered in the model's order, so this"
                    " optimizer's state would land on other parameters when loaded without the pipeline; list each"
                    " group's parameters in the model's order (filter self.named_parameters())"
                )
    groups = []
    for index, group_ in enumerate(optimizer_state["param_groups"]):
        names = {name for lists in gathered for name in lists[index]}
        groups.append({**group_, "params": sorted(names, key=lambda name: position.get(name, len(order)))})
    return {**optimizer_state, "param_groups": groups}


def keyed_by_index(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The inverse for one file readable by a plain ``optimizer.load_state_dict``: parameters numbered in
    param-group order, as ``torch.optim.Optimizer.state_dict`` numbers them."""
    groups = optimizer_state.get("param_groups", [])
    order = [name for group in groups for name in group.get("params", [])]
    if not order or isinstance(order[0], int):
        return optimizer_state
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in optimizer_state.get("state", {}).items()},
        "param_groups": [{**group, "params": [index[p] for p in group["params"]]} for group in groups],
    }
