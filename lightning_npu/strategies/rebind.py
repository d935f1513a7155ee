"""Optimizers made from a model before it was sharded, moved onto the sharded parameters.

``fully_shard`` replaces every parameter of a unit with a new (DTensor) one. An optimizer created from the unsharded
model, the usual Fabric pattern (``model, optimizer = fabric.setup(model, optimizer)``), still holds the old
parameters: its steps would update tensors the model no longer uses, and nothing would fail. The strategy records
which parameter replaced which when it shards a module, and moves each optimizer it sets up onto the replacements:
the param groups keep their order and options, and state already held (moments of earlier steps, a loaded
``optimizer.state_dict()``) is sharded the way its parameter is. A parameter sharding removed from the model (another
pipeline stage's) leaves the optimizer with its state.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer


class ReplacedParameters:
    """Which parameter replaced which, for the modules a strategy sharded."""

    def __init__(self) -> None:
        # By the replaced parameter's id: its weak reference (ids are reused) and its replacement, None if removed.
        self._replacement: dict[int, tuple[weakref.ref, Optional[nn.Parameter]]] = {}

    @staticmethod
    def before(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """``module``'s parameters by every name they have, taken before sharding."""
        return list(module.named_parameters(remove_duplicate=False))

    def record(self, module: nn.Module, before: list[tuple[str, nn.Parameter]]) -> None:
        """Remember, after sharding ``module``, the parameter that now stands at each of ``before``'s names (None
        where the name is gone)."""
        after = dict(module.named_parameters(remove_duplicate=False))
        for name, old in before:
            if after.get(name) is not old:
                self._replacement[id(old)] = (weakref.ref(old), after.get(name))

    def replacement(self, param: Tensor) -> Optional[Tensor]:
        """The sharded parameter that replaced ``param``, None if it was removed, or ``param`` itself if it was not
        replaced."""
        found = self._replacement.get(id(param))
        if found is None or found[0]() is not param:  # an id reused by another object
            return param
        return found[1]

    def rebind(self, optimizer: Optimizer) -> None:
        """Move ``optimizer``'s param groups and state from replaced parameters onto their replacements (dropping
        removed ones)."""
        moved = {}
        for group in optimizer.param_groups:
            group["params"] = [new for new in map(self.replacement, group["params"]) if new is not None]
        for old in list(optimizer.state):
            new = self.replacement(old)
            if new is None:
                del optimizer.state[old]
            elif new is not old:
                moved[new] = {key: _shard_like(value, key, old, new) for key, value in optimizer.state.pop(old).items()}
        optimizer.state.update(moved)


def _shard_like(value: Any, key: str, old: Tensor, new: Tensor) -> Any:
    """An optimizer state entry of the unsharded ``old``, as the matching entry of the sharded ``new``."""
    if not isinstance(value, Tensor) or value.ndim == 0 or not isinstance(new, DTensor):
        return value  # step counters and other scalars are the same for every shard
    if value.shape != old.shape:
        raise ValueError(
            f"the optimizer's state {key!r} has shape {tuple(value.shape)}, its parameter {tuple(old.shape)}: npu_fsdp"
            " cannot shard it with the parameter. Set the model up first (`model = fabric.setup_module(model)`), then"
            " create the optimizer from model.parameters() and call `fabric.setup_optimizers(optimizer)`"
        )
    with torch.no_grad():
        # distribute_tensor sends rank 0's values, as the parameters themselves are sent (initial_state).
        sharded = distribute_tensor(value.detach(), new.device_mesh, new.placements)
    local_device = new.to_local().device
    return sharded if sharded.to_local().device == local_device else sharded.to(local_device)


__all__ = ["ReplacedParameters"]
