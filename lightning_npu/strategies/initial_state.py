"""A sharded model's first weights are exactly what the user's code made, and the same on every rank.

npu_fsdp shards a model that may exist on each rank (built in ``__init__``), only on rank 0 (built in
``configure_model``: the other ranks build it on the meta device, so no rank but one holds a full host copy), or
nowhere (built on the meta device on purpose: ``trainer.init_module(empty_init=True)``,
``fabric.init_module(empty_init=True)`` or ``with torch.device("meta")`` in ``configure_model``). Rank 0 decides:

- a tensor that is real on rank 0 is sent from rank 0 to every rank after sharding (each keeps its shard), as
  DDP broadcasts rank 0's weights: custom initialisation, weights loaded from a file and buffers of modules
  without ``reset_parameters`` all survive, identical on every rank;
- a tensor that is on the meta device on rank 0 was left uninitialised on purpose, and is initialised after
  sharding by its module's ``reset_parameters()``, shard by shard; a module that has none is an error naming it,
  raised before anything is sharded.

Parameters and buffers are materialised on the device the mesh computes on, so random initialisation of a
shard draws from that device's generator, which DTensor offsets per rank (a CPU shard of an NPU mesh would
draw the same numbers on every rank); with CPU offload the strategy moves the shards to the host afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


class MaterializationError(TypeError):
    """A module left on the meta device cannot be initialised: it has no ``reset_parameters``."""


@dataclass
class InitialState:
    """What rank 0 holds before sharding: which tensors are left uninitialised (meta), and the others' values.

    ``values`` holds references (no copy) to rank 0's real parameters, by every name they have (tied ones
    included); it is empty on the other ranks.
    """

    meta_names: frozenset[str]
    values: dict[str, Tensor] = field(default_factory=dict)


def capture(model: nn.Module) -> InitialState:
    """Take rank 0's view of ``model`` before sharding (a collective: every rank calls it)."""
    rank0 = _rank() == 0
    meta = [sorted(name for name, tensor in _named_tensors(model) if tensor.is_meta)] if rank0 else [None]
    if _distributed():
        dist.broadcast_object_list(meta, src=0)
    meta_names = frozenset(meta[0])
    _check_materializable(model, meta_names)
    values = {}
    if rank0:
        # Parameters that are DTensors already (sharded by the user in configure_model) hold their values on
        # every rank.
        values = {name: param for name, param in model.named_parameters(remove_duplicate=False)
                  if name not in meta_names and not isinstance(param, DTensor)}
    return InitialState(meta_names, values)


def apply(model: nn.Module, state: InitialState, device: torch.device) -> None:
    """Give the sharded ``model`` its first values on every rank (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for module in model.modules():
        if any(t.is_meta for t in chain(module.parameters(recurse=False), module.buffers(recurse=False))):
            module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for _, module in _named_owners(model, state.meta_names):
            module.reset_parameters()
    if not _distributed():
        return
    set_model_state_dict(
        model, state.values,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
    )
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name not in state.meta_names:
                dist.broadcast(buffer, src=0)


def _check_materializable(model: nn.Module, meta_names: frozenset[str]) -> None:
    missing = sorted(
        {f"{name or type(model).__name__} ({type(module).__name__})" for name, module in _named_owners(model, meta_names)
         if not callable(getattr(module, "reset_parameters", None))}
    )
    if missing:
        raise MaterializationError(
            f"npu_fsdp cannot initialise {', '.join(missing)}: its parameters or buffers were created on the meta"
            " device, and it has no reset_parameters() to initialise them after sharding. Give the module a"
            " reset_parameters() method, or create it for real (outside torch.device('meta') / empty_init=True):"
            " rank 0's values are then sent to every rank."
        )


def _named_owners(model: nn.Module, names: frozenset[str]) -> list[tuple[str, nn.Module]]:
    """The modules that directly hold a tensor named in ``names``, each once, in module order."""
    owners = []
    for prefix, module in model.named_modules():
        own = chain(module.named_parameters(prefix, recurse=False), module.named_buffers(prefix, recurse=False))
        if any(name in names for name, _ in own):
            owners.append((prefix, module))
    return owners


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    return chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0

