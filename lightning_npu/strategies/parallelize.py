"""Small functions that shard and checkpoint a finished model; the FSDP strategies call them by policy.

The model code knows nothing of parallelism: which modules become FSDP units and which recompute their
activations is decided here from module classes.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Literal, Optional, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: Module classes given as classes (Python) or as names: a dotted import path or a bare class name (YAML).
MODULE_CLASSES = Union[Iterable[Union[str, type]], None]
SHARDING = Literal["full", "hybrid"]


def build_mesh(device_type: str, world_size: int, num_nodes: int, sharding: SHARDING) -> DeviceMesh:
    """1-D mesh ``("shard",)`` for full sharding; 2-D ``("replicate", "shard")`` for hybrid sharding, which
    shards within a node and replicates across nodes (so parameter all-gathers stay on the fast intra-node links)."""
    if sharding == "hybrid":
        if world_size % num_nodes:
            raise ValueError(f"hybrid sharding needs the same number of devices on each of the {num_nodes} nodes")
        return init_device_mesh(device_type, (num_nodes, world_size // num_nodes), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))


def resolve_module_classes(spec: MODULE_CLASSES, model: nn.Module, option: str) -> tuple[type, ...]:
    """Turn a policy (classes, dotted paths or class names found in ``model``) into a tuple of classes."""
    if spec is None:
        return ()
    if isinstance(spec, (str, type)):
        spec = [spec]
    in_model = {type(module).__name__: type(module) for module in model.modules()}
    classes = []
    for entry in spec:
        if isinstance(entry, type):
            classes.append(entry)
        elif "." in entry:
            module_name, _, class_name = entry.rpartition(".")
            try:
                classes.append(getattr(importlib.import_module(module_name), class_name))
            except (ImportError, AttributeError) as error:
                raise ValueError(f"{option}: cannot import {entry!r} ({error}); give an importable class path") from None
        elif entry in in_model:
            classes.append(in_model[entry])
        else:
            raise ValueError(
                f"{option}: no module class named {entry!r} in the model; its module classes are:"
                f" {', '.join(sorted(in_model))}"
            )
    return tuple(classes)


def evenly_spaced(count: int, ratio: float) -> list[int]:
    """Indices of ``round(count * ratio)``-ish items spread evenly over ``count`` (ratio 0.5 of 4 -> [1, 3])."""
    return [i for i in range(count) if int((i + 1) * ratio) > int(i * ratio)]


def apply_activation_checkpointing(model: nn.Module, classes: tuple[type, ...], ratio: float) -> list[str]:
    """Recompute the activations of a ``ratio`` share of the modules of ``classes`` (evenly spaced) in backward.

    Uses the composable ``checkpoint``, which keeps parameter names (and so checkpoints) unchanged.
    Returns the names of the checkpointed modules.
    """
    from torch.distributed._composable import checkpoint

    matching = [(name, module) for name, module in model.named_modules() if isinstance(module, classes)]
    chosen = [matching[i] for i in evenly_spaced(len(matching), ratio)]
    for _, module in chosen:
        checkpoint(module)
    return [name for name, _ in chosen]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    wrap_classes: tuple[type, ...],
    roots: list[nn.Module],
    reshard_after_forward: bool,
    mp_policy: object,
    cpu_offload: bool,
) -> list[str]:
    """``fully_shard`` every module of ``wrap_classes`` (innermost first), then each of ``roots``.

    Modules that are already FSDP units, or lie inside one, are left as the user sharded them.
    Returns the names of the modules sharded here.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        # Pinned host memory needs an accelerator; on a simulated (CPU) mesh there is none.
        "offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy(),
    }
    inside_fsdp = _modules_inside_fsdp(model, FSDPModule)
    sharded = []
    names = {id(module): name for name, module in model.named_modules()}
    blocks = [m for m in model.modules() if isinstance(m, wrap_classes) and id(m) not in inside_fsdp]
    for block in reversed(blocks):  # innermost first: FSDP units must be created bottom-up
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
        sharded.append(names[id(block)])
    for root in roots:
        if id(root) in inside_fsdp or isinstance(root, FSDPModule):
            continue
        fully_shard(root, reshard_after_forward=reshard_after_forward, **kwargs)
        sharded.append(names.get(id(root), ""))
    return sharded


def _modules_inside_fsdp(model: nn.Module, fsdp_type: type) -> set[int]:
    """ids of modules that are FSDP units or descendants of one."""
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, fsdp_type) and id(module) not in inside:
            inside.update(id(sub) for sub in module.modules())
    return inside


def sharded_fraction(module: nn.Module) -> Optional[float]:
    """Local parameter elements over global parameter elements on this rank (None without parameters)."""
    local = total = 0
    for param in module.parameters():
        total += param.numel()
        local += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
    return local / total if total else None


__all__ = [
    "apply_activation_checkpointing",
    "apply_fsdp",
    "build_mesh",
    "evenly_spaced",
    "resolve_module_classes",
    "sharded_fraction",
]
