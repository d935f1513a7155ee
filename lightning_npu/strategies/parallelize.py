"""Small functions that shard and checkpoint a finished model; the FSDP strategies call them by policy, in order:
tensor parallelism by a plan, context parallelism, activation checkpointing, FSDP by policy, the root unit.

The model code knows nothing of parallelism: which modules become FSDP units and which recompute their
activations is decided here from module classes; how a model splits over tensor-parallel ranks comes from a plan
its family provides (``apply_tensor_parallel``); which modules split the sequence over context-parallel ranks, from
the modules that ask for it (``apply_context_parallel``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Callable, Literal, Optional, Union

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_npu.facts.options import evenly_spaced  # torch-free: lightning-npu plan picks the same blocks

#: Module classes given as classes (Python) or as names: a dotted import path or a bare class name (YAML).
MODULE_CLASSES = Union[Iterable[Union[str, type]], None]
SHARDING = Literal["full", "hybrid"]
#: A tensor-parallel plan: a callable ``plan(model, tp_mesh, *, sequence_parallel, loss_parallel)`` returning
#: ``parallelize_module``'s plan (module name -> ParallelStyle), or its import path (``"pkg.module.function"``).
TENSOR_PARALLEL_PLAN = Union[str, Callable[..., Any], None]


def resolve_tensor_parallel_plan(spec: TENSOR_PARALLEL_PLAN, model: nn.Module) -> Optional[Callable[..., Any]]:
    """The plan function ``spec`` names; without one, the model's own ``tensor_parallel_plan(tp_mesh, *,
    sequence_parallel, loss_parallel)`` method, if it has one (None: the model is left as it is)."""
    if spec is not None:
        return import_tensor_parallel_plan(spec)
    method = getattr(model, "tensor_parallel_plan", None)
    return (lambda _model, mesh, **flags: method(mesh, **flags)) if callable(method) else None


def import_tensor_parallel_plan(spec: Union[str, Callable[..., Any]]) -> Callable[..., Any]:
    """The function an import path (``"pkg.module.function"`` or ``"pkg.module:function"``) names, or ``spec``
    itself if it is one; ValueError otherwise (checked when the strategy is made, before workers start)."""
    if callable(spec):
        return spec
    module_name, _, name = str(spec).replace(":", ".").rpartition(".")
    try:
        plan = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"tensor_parallel_plan: cannot import {spec!r} ({error}); give the import path of a function"
            " plan(model, tp_mesh, *, sequence_parallel, loss_parallel) -> {module name: ParallelStyle}"
        ) from None
    if not callable(plan):
        raise ValueError(f"tensor_parallel_plan={spec!r} names an object of type {type(plan).__name__}, not a function")
    return plan


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Callable[..., Any], *, sequence_parallel: bool, loss_parallel: bool,
) -> list[str]:
    """Split the modules ``plan`` names over the tensor-parallel ranks of ``tp_mesh``; returns their names.

    Each rank keeps its local split of its own values (no scatter): rank 0's whole values reach every rank after
    sharding (``initial_state``), so ranks that built on the meta device need no peer here.
    """
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    styles = plan(model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if not isinstance(styles, dict) or not all(isinstance(style, ParallelStyle) for style in styles.values()):
        raise TypeError(
            f"tensor_parallel_plan returned {type(styles).__name__}; it must return a dict of module names to"
            " torch.distributed.tensor.parallel styles (ColwiseParallel(), RowwiseParallel(), ...)"
        )
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    return sorted(styles)


def apply_context_parallel(model: nn.Module, context_parallel: Any) -> list[str]:
    """Give ``context_parallel`` (a ``lightning_npu.kernels.context_parallel.ContextParallel``) to every module of
    ``model`` (itself included) whose class declares a ``context_parallel`` attribute: the modules that shard the
    batch by sequence and run attention over it (``context_parallel.shard`` / ``.attention``); returns their names.

    A class attribute ``context_parallel = None`` is the module's opt-in, as a ``tensor_parallel_plan`` method is for
    tensor parallelism; the model's code imports nothing of the strategy and runs unchanged without it.
    """
    given = []
    for name, module in model.named_modules():
        if "context_parallel" in dir(type(module)):
            module.context_parallel = context_parallel
            given.append(name or type(module).__name__)
    return given


def tensor_parallel_parameters(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters split over tensor-parallel ranks (by a plan or by the user's code)."""
    from torch.distributed.tensor import DTensor

    from lightning_npu.strategies.mesh import TENSOR_PARALLEL_DIMS

    return [name for name, param in model.named_parameters()
            if isinstance(param, DTensor) and TENSOR_PARALLEL_DIMS & set(param.device_mesh.mesh_dim_names or ())]


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


def apply_activation_checkpointing(model: nn.Module, classes: tuple[type, ...], ratio: float) -> list[str]:
    """Recompute the activations of a ``ratio`` share of the modules of ``classes`` (evenly spaced) in backward.

    Uses the composable ``checkpoint``, which keeps parameter names (and so checkpoints) unchanged. Modules the
    user's code checkpointed already (see ``checkpointed_by_hand``) are left as they are, and so is every chosen
    module inside or around one: checkpointing it too would recompute those activations twice. That is said in a
    warning, as Lightning's FSDP strategies warn (they then ignore the policy altogether).
    Returns the names of the modules checkpointed here.
    """
    from lightning_npu.compat import composable_checkpoint

    matching = [(name, module) for name, module in model.named_modules() if isinstance(module, classes)]
    chosen = [matching[i] for i in evenly_spaced(len(matching), ratio)]
    by_hand = checkpointed_by_hand(model)
    if chosen and by_hand:
        covered = {id(sub) for _, module in by_hand for sub in module.modules()}  # checkpointed, or inside one
        around = [(name, module) for name, module in chosen
                  if id(module) in covered or any(id(sub) in covered for sub in module.modules())]
        chosen = [entry for entry in chosen if entry not in around]
        rank_zero_warn(
            f"activation_checkpointing_policy is set, but the model already contains checkpointed layers"
            f" ({', '.join(name for name, _ in by_hand)}; checkpoint_wrapper, apply_activation_checkpointing or"
            f" torch.distributed._composable.checkpoint). They stay as they are, and the {len(around)} modules of"
            f" the policy inside or around them are not checkpointed again"
            f"{': ' + ', '.join(name for name, _ in around) if around else ''}, so nothing is recomputed twice."
        )
    for _, module in chosen:
        composable_checkpoint(module)
    return [name for name, _ in chosen]


def checkpointed_by_hand(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` whose activations are recomputed already: wrapped by torch's ``checkpoint_wrapper``
    (also what ``apply_activation_checkpointing`` does) or given the composable ``checkpoint()``. A
    ``torch.utils.checkpoint.checkpoint`` call inside a ``forward`` cannot be seen from outside."""
    from lightning_npu.compat import CheckpointWrapper, composable_checkpoint

    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, CheckpointWrapper) or composable_checkpoint.state(module) is not None]


#: The LightningModule methods that run a step: each gathers the root unit's parameters, like ``forward``.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


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
) -> list[str]:
    """``fully_shard`` every module of ``wrap_classes`` (innermost first), then ``model`` itself as the root unit,
    which holds every parameter left over (containers, heads, embeddings, parameters of ``model`` itself).

    Every parameter thus belongs to exactly one unit, except scalar (0-d) parameters, which FSDP2 cannot shard:
    they stay whole on every rank and their gradients are averaged over ranks as DDP would. A block holding a
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
    average_gradients_over_ranks(scalars)
    return sharded


def fully_shard_options(mesh: DeviceMesh, mp_policy: object, cpu_offload: bool) -> dict[str, Any]:
    """``fully_shard``'s mixed-precision and offload arguments, the same for every unit of a run."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    # Pinned host memory needs an accelerator; on a simulated (CPU) mesh there is none.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    return {"mp_policy": mp_policy, "offload_policy": offload}


def average_gradients_over_ranks(params: Iterable[nn.Parameter]) -> None:
    """Keep replicated parameters equal on every rank: average each one's gradient as soon as it is accumulated."""
    import torch.distributed as dist

    def average(param: nn.Parameter) -> None:
        dist.all_reduce(param.grad)
        param.grad.div_(dist.get_world_size())

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


__all__ = [
    "apply_activation_checkpointing",
    "apply_fsdp",
    "apply_tensor_parallel",
    "average_gradients_over_ranks",
    "checkpointed_by_hand",
    "evenly_spaced",
    "fully_shard_options",
    "import_tensor_parallel_plan",
    "repeated_block_class",
    "resolve_module_classes",
    "resolve_tensor_parallel_plan",
    "tensor_parallel_parameters",
]
