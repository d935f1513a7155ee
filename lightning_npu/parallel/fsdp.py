"""FSDP2 by policy: which modules become ``fully_shard`` units (the repeated block by default), the root unit, and
the parameters FSDP cannot shard (scalars).

The model code knows nothing of this: which modules become units is decided from module classes, given by the
``auto_wrap_policy`` option or inferred (:func:`repeated_block_class`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

#: Module classes given as classes (Python) or as names: a dotted import path or a bare class name (YAML).
MODULE_CLASSES = Union[Iterable[Union[str, type]], None]


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


#: The LightningModule methods that run a step: each gathers the root unit's parameters, like ``forward``.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def wrap_classes(policy: MODULE_CLASSES, model: nn.Module) -> tuple[tuple[type, ...], str]:
    """The block classes that become FSDP units under ``policy`` (``auto_wrap_policy``), and how they were chosen
    (for the log). Without a policy, the repeated block; an explicit empty policy means a single unit."""
    if policy is not None:
        classes = resolve_module_classes(policy, model, "auto_wrap_policy")
        return classes, f"auto_wrap_policy={[cls.__name__ for cls in classes]}"
    block = repeated_block_class(model)
    if block is None:
        return (), "no repeated block found, so one unit; set auto_wrap_policy to choose blocks"
    return (block,), f"auto_wrap_policy chosen: {block.__name__}, the repeated block; pass auto_wrap_policy=[] for one unit"


def repeated_block_class(model: nn.Module) -> Optional[type]:
    """The module class whose instances are the model's repeated blocks, or None if no class repeats.

    Candidates are the classes with a ``forward`` (containers cannot be FSDP units) and at least two instances
    holding parameters. Of those, only the outermost count (no instance lies inside an instance of another
    candidate, so a decoder block wins over the Linear layers inside it), and of those the one whose instances
    hold the most parameter elements.
    """
    sizes: dict[type, list[int]] = {}
    enclosing: dict[type, set[type]] = {}

    def visit(module: nn.Module, ancestors: frozenset) -> None:
        for child in module.children():
            if type(child).forward is not nn.Module.forward:
                size = sum(p.numel() for p in child.parameters())
                if size:
                    sizes.setdefault(type(child), []).append(size)
                    enclosing.setdefault(type(child), set()).update(ancestors)
                visit(child, ancestors | {type(child)})
            else:
                visit(child, ancestors)

    visit(model, frozenset())
    candidates = {cls for cls, found in sizes.items() if len(found) >= 2}
    outermost = [cls for cls in candidates if not (enclosing[cls] - {cls}) & candidates]
    return max(outermost, key=lambda cls: sum(sizes[cls]), default=None)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    wrap_classes: tuple[type, ...],
    reshard_after_forward: bool,
    mp_policy: object,
    cpu_offload: bool,
    step_methods: Iterable[str] = (),
    scalar_group: Optional[Any] = None,
) -> list[str]:
    """``fully_shard`` every module of ``wrap_classes`` (innermost first), then ``model`` itself as the root unit,
    which holds every parameter left over (containers, heads, embeddings, parameters of ``model`` itself).

    Every parameter thus belongs to exactly one unit, except scalar (0-d) parameters, which FSDP2 cannot shard:
    they stay whole on every rank and their gradients are averaged over ``scalar_group`` (the data-parallel ranks;
    None: every rank) as DDP would. A block holding a
    parameter that is also reachable from outside it (a tied embedding and head) is left to the root, so tied
    parameters stay one parameter. The root's parameters are gathered by its ``forward`` and by each of
    ``step_methods`` (a ``training_step`` need not call ``forward``), and stay gathered until backward (they are
    needed again at once).
    Modules that are already FSDP units, or lie inside one, are left as the user sharded them.
    Returns the names of the modules sharded here (``""`` for the root).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    scalars = {param for param in model.parameters() if param.ndim == 0}
    kwargs = {"mesh": mesh, "ignored_params": scalars, **fully_shard_options(mesh, mp_policy, cpu_offload)}
    inside_fsdp = _modules_inside_fsdp(model, FSDPModule)
    names = {id(module): name for name, module in model.named_modules()}
    blocks = [
        module for module in model.modules()
        if isinstance(module, wrap_classes) and module is not model and id(module) not in inside_fsdp
    ]
    shared = _parameters_shared_outside(model, blocks)
    sharded = []
    for block in reversed(blocks):  # innermost first: FSDP units must be created bottom-up
        if any(id(param) in shared for param in block.parameters()):
            continue
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
        sharded.append(names[id(block)])
    if not isinstance(model, FSDPModule):
        fully_shard(model, reshard_after_forward=False, **kwargs)
        sharded.append("")
    for method in step_methods:
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    average_gradients_over_ranks(scalars, scalar_group)
    return sharded


def fully_shard_options(mesh: DeviceMesh, mp_policy: object, cpu_offload: bool) -> dict[str, Any]:
    """``fully_shard``'s mixed-precision and offload arguments, the same for every unit of a run."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    # Pinned host memory needs an accelerator; on a simulated (CPU) mesh there is none.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    return {"mp_policy": mp_policy, "offload_policy": offload}


def average_gradients_over_ranks(params: Iterable[nn.Parameter], group: Optional[Any] = None) -> None:
    """Keep replicated parameters equal on the ranks of ``group`` (None: every rank): average each one's gradient
    over them as soon as it is accumulated."""
    import torch.distributed as dist

    def average(param: nn.Parameter) -> None:
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(dist.get_world_size(group))

    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)


def _parameters_shared_outside(model: nn.Module, blocks: list[nn.Module]) -> set[int]:
    """ids of parameters that a block holds and that are also reachable from outside that block."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    shared = set()
    for block in blocks:
        inside = {id(sub) for sub in block.modules()}
        shared.update(pid for pid in (id(p) for p in block.parameters()) if not owners[pid] <= inside)
    return shared


def _modules_inside_fsdp(model: nn.Module, fsdp_type: type) -> set[int]:
    """ids of modules that are FSDP units or descendants of one."""
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, fsdp_type) and id(module) not in inside:
            inside.update(id(sub) for sub in module.modules())
    return inside


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer of ``model`` that is not on ``device`` (nor on the meta device, which the first values fill)
    moved there; registered buffers stay registered. FSDP moves what its units hold; under a pipeline the buffers
    outside every stage (on the LightningModule itself, or parameter-free modules beside the pipelined one) would
    stay where they were built."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                setattr(module, name, buffer.to(device))


def reshard(module: nn.Module) -> None:
    """Register every FSDP unit's sharded parameters in ``module`` again: a unit keeps its parameters gathered after
    a forward no backward follows (evaluation; ``reshard_after_forward=False``), and a checkpoint must load into the
    shards, an optimizer's step reach them."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


__all__ = [
    "STEP_METHODS",
    "apply_fsdp",
    "average_gradients_over_ranks",
    "fully_shard_options",
    "move_buffers",
    "repeated_block_class",
    "reshard",
    "resolve_module_classes",
    "wrap_classes",
]
