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

A module the user shards with ``fully_shard`` in ``configure_model`` is sharded before npu_fsdp sees it: rank 0 then
holds only its own shard, and the other ranks (which built on the meta device) hold none. While ``configure_model``
runs on rank 0, :func:`recording_built_parameters` therefore remembers every parameter a module registers; the
parameter FSDP replaced still holds the full value the user's code built, and rank 0 sends that (after checking that
its own shard is still part of it). A user-sharded parameter that rank 0 cannot vouch for (changed after sharding,
or created as a DTensor directly) is an error when another rank holds no value for it.

Parameters and buffers are materialised on the device the mesh computes on, so random initialisation of a
shard draws from that device's generator, which DTensor offsets per rank (a CPU shard of an NPU mesh would
draw the same numbers on every rank); with CPU offload the strategy moves the shards to the host afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import Iterator, Optional
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_npu.parallel.mesh import TENSOR_PARALLEL_DIMS


class MaterializationError(TypeError):
    """A module left on the meta device cannot be initialised: it has no ``reset_parameters``."""


@dataclass
class InitialState:
    """What rank 0 holds before sharding: which tensors are left uninitialised (meta), and the others' values.

    ``values`` holds references (no copy) to rank 0's real parameters, by every name they have (tied ones
    included), and ``buffers`` to its real buffers; both are empty on the other ranks. Rank 0 may hold only part of
    the model after sharding (a pipeline stage): these still hold the whole model's.
    """

    meta_names: frozenset[str]
    values: dict[str, Tensor] = field(default_factory=dict)
    buffers: dict[str, Tensor] = field(default_factory=dict)


class BuiltParameters:
    """The plain parameters modules registered while recording, by module and attribute name (the last one wins)."""

    def __init__(self) -> None:
        self._by_module: WeakKeyDictionary[nn.Module, dict[str, Tensor]] = WeakKeyDictionary()

    def record(self, module: nn.Module, name: str, param: Tensor) -> None:
        if not isinstance(param, DTensor):
            self._by_module.setdefault(module, {})[name] = param

    def full_value(self, model: nn.Module, name: str, sharded: DTensor) -> Optional[Tensor]:
        """What the user's code built for the parameter ``name`` of ``model``, now the DTensor ``sharded``; None if
        nothing was recorded for it or the recorded value no longer matches this rank's shard."""
        owner_name, _, attribute = name.rpartition(".")
        built = self._by_module.get(model.get_submodule(owner_name), {}).get(attribute)
        if built is None or built.is_meta or built.shape != sharded.shape:
            return None
        # Rank 0 sits at coordinate 0 of every mesh dimension, so its shard starts at offset 0 in each dimension.
        local = sharded.to_local()
        with torch.no_grad():
            corner = built[tuple(slice(0, size) for size in local.shape)]
            return built if torch.equal(corner.to(local.device, local.dtype), local) else None


@contextmanager
def recording_built_parameters() -> Iterator[BuiltParameters]:
    """Remember the parameters every module registers inside this context (see the module docstring)."""
    built = BuiltParameters()
    handle = nn.modules.module.register_module_parameter_registration_hook(built.record)
    try:
        yield built
    finally:
        handle.remove()


def capture(model: nn.Module, built: Optional[BuiltParameters] = None) -> InitialState:
    """Take rank 0's view of ``model`` before sharding (a collective: every rank calls it). ``built``: what rank 0's
    ``configure_model`` built (:func:`recording_built_parameters`), for the parameters the user sharded there."""
    rank0 = _rank() == 0
    values: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    view: list = [None]
    if rank0:
        meta_names = frozenset(name for name, tensor in _named_tensors(model) if tensor.is_meta)
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in meta_names:
                continue
            if not isinstance(param, DTensor):
                values[name] = param
            elif built is not None and (full := built.full_value(model, name, param)) is not None:
                values[name] = full
        buffers = {name: buffer for name, buffer in model.named_buffers() if name not in meta_names}
        user_sharded = {name for name, param in model.named_parameters(remove_duplicate=False)
                        if isinstance(param, DTensor)}
        view = [(sorted(meta_names), sorted(user_sharded - meta_names - values.keys()))]
    if _distributed():
        dist.broadcast_object_list(view, src=0)
    meta, unvouched = view[0]
    meta_names = frozenset(meta)
    _check_materializable(model, meta_names)
    _check_user_sharded(model, frozenset(unvouched))
    return InitialState(meta_names, values, buffers)


def apply(model: nn.Module, state: InitialState, device: torch.device) -> None:
    """Give the sharded ``model`` its first values on every rank (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for module in model.modules():
        if any(t.is_meta for t in chain(module.parameters(recurse=False), module.buffers(recurse=False))):
            module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for _, module in _named_owners(model, state.meta_names):
            if any(_split_over_tensor_parallel(p) for p in module.parameters(recurse=False)):
                _reset_whole_then_distribute(module)
            else:
                module.reset_parameters()
    if not _distributed():
        return
    set_model_state_dict(
        model, state.values,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
    )
    _send_buffers(model, state.buffers, device)


def _send_buffers(model: nn.Module, buffers: dict[str, Tensor], device: torch.device) -> None:
    """Rank 0's ``buffers`` (by name) into the buffers of those names on every rank; a rank holding none of a name
    (another pipeline stage's) takes part in its broadcast only."""
    listed = [[(name, buffer.shape, buffer.dtype) for name, buffer in buffers.items()]]
    dist.broadcast_object_list(listed, src=0)
    own = dict(model.named_buffers())
    with torch.no_grad():
        for name, shape, dtype in listed[0]:
            sent = buffers[name].to(device, copy=True) if name in buffers else torch.empty(shape, dtype=dtype,
                                                                                           device=device)
            dist.broadcast(sent, src=0)
            if name in own:
                own[name].copy_(sent)


def _split_over_tensor_parallel(param: Tensor) -> bool:
    return isinstance(param, DTensor) and bool(TENSOR_PARALLEL_DIMS & set(param.device_mesh.mesh_dim_names or ()))


def _reset_whole_then_distribute(module: nn.Module) -> None:
    """``module.reset_parameters()`` for parameters split over tensor-parallel ranks (next to FSDP): each parameter
    is initialised whole, then every rank keeps its part of rank 0's values.

    DTensor's random ops draw a shard's numbers from an offset computed for its placements, and for the strided
    placements of a tensor-parallel split under FSDP that offset is the same on the ranks of a tensor-parallel
    group: reset shard by shard, every rank of a column-split projection would draw the same numbers (duplicated
    heads, a silently degenerate start). Whole, each parameter is drawn exactly as on one device. One module's
    parameters at a time are held whole.
    """
    from torch.distributed.tensor import distribute_tensor

    sharded = {name: param for name, param in module.named_parameters(recurse=False) if isinstance(param, DTensor)}
    for name, param in sharded.items():
        whole = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        module.register_parameter(name, nn.Parameter(whole, requires_grad=param.requires_grad))
    try:
        module.reset_parameters()
        for name, param in sharded.items():
            whole = getattr(module, name).detach()
            param.to_local().copy_(distribute_tensor(whole, param.device_mesh, param.placements).to_local())
    finally:
        for name, param in sharded.items():
            module.register_parameter(name, param)


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


def _check_user_sharded(model: nn.Module, unvouched: frozenset[str]) -> None:
    """Fail on every rank alike if a rank holds no value (meta) for a user-sharded parameter rank 0 cannot send."""
    empty = [sorted(name for name, param in model.named_parameters(remove_duplicate=False)
                    if name in unvouched and param.is_meta)]
    if _distributed():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, empty[0])
        empty = gathered
    missing = sorted({name for names in empty for name in names})
    if missing:
        raise MaterializationError(
            f"npu_fsdp cannot give {', '.join(missing)} its first values: the module was sharded with fully_shard in"
            " configure_model, which builds on the meta device on every rank but 0, and rank 0 no longer holds the"
            " whole value it built (its shard changed after fully_shard, or the parameter was created as a DTensor)."
            " Initialise the module before calling fully_shard, or build it on the meta device on every rank"
            " (`with torch.device('meta')`) and give it a reset_parameters() method."
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

