"""How a model says how it splits over ranks: one method, ``parallel_plan()``, returning a ``ParallelPlan``.

npu_fsdp asks the module it shards (the LightningModule under the Trainer, the module given to ``fabric.setup``)::

    def parallel_plan(self) -> ParallelPlan: ...

or calls the function the strategy's ``parallel_plan`` option names, ``plan(module) -> ParallelPlan``, for a module
that cannot define the method. Every field is optional: a module without a plan is sharded by FSDP alone, and a
module written for Lightning's ``ModelParallelStrategy`` (its ``configure_model`` calls ``parallelize_module`` and
``fully_shard`` on ``self.device_mesh``) shards itself as it would there. Module names are relative to the module
that returns the plan (``""`` is that module itself).

``tensor_parallel``
    ``plan(tp_mesh, *, sequence_parallel, loss_parallel) -> {module name: ParallelStyle}``, applied with torch's
    ``parallelize_module`` under ``tensor_parallel_size > 1`` (the strategy's ``sequence_parallel`` and
    ``loss_parallel`` options are passed on; under ``loss_parallel`` the Trainer runs the steps and backward inside
    torch's ``loss_parallel()``).
``context_parallel``
    The modules that split sequences over the ``context_parallel_size`` ranks: each gets the group as its
    ``context_parallel`` attribute, a :class:`lightning_npu.parallel.context.ContextParallel` (which part of a
    sequence this rank holds: ``shard``, ``positions``; attention over the whole sequence: ``attention``). The module
    that shards the batch and those that run attention both need it.
``experts``
    The modules holding an MoE layer's experts: every parameter (those of submodules too: per-expert adapters)
    stacks the experts on dim 0, ``forward(rows, counts)`` runs rows sorted by expert (``counts[e]`` rows for
    expert ``e``) and returns one output row per input row, in order, computing with
    :func:`~lightning_npu.parallel.expert.local_experts` of each parameter. Expert parallelism
    (``expert_parallel_size``) splits them over ranks and moves the rows; under tensor parallelism each
    tensor-parallel rank runs a share of the rows. The experts are never split by a tensor-parallel plan.
``pipeline``
    A :class:`PipelineLayout`: the module that pipelines under ``pipeline_parallel_size > 1`` and its parts, an
    "inputs -> blocks -> outputs" model (the embedding, a ``ModuleList`` of blocks, the final norm and head). That
    module's ``forward(x, *, labels=None, **kwargs)`` gives, with ``labels``, the loss (the mean over the labels that
    are not -100), computed by its ``loss(output, labels, reduction)``; and it runs with parts set to ``None``: the
    first stage gets the inputs, the others the previous stage's activations (one tensor), the last returns the
    output its ``loss`` takes (called with ``reduction="sum"``). ``kwargs`` (per-row tensors) reach every stage;
    with ``PipelineLayout.positions`` the rows' positions are one of them, given by the pipeline where the caller
    gives none, so a later stage knows the whole sequence's positions whatever part of it its input holds.
    Every parameter lies in one part (none tied across stages), the blocks are an ``nn.ModuleList``: what
    ``parallel.pipeline.check_split`` checks, before workers start. Under pipeline parallelism npu_fsdp
    keeps each rank's stages of it (parameter names unchanged) and its ``forward`` with ``labels`` runs the schedule:
    every microbatch's forward and backward, returning the step's loss on every rank.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

from torch import nn

#: ``plan(tp_mesh, *, sequence_parallel, loss_parallel)`` -> ``{module name: ParallelStyle}``.
TensorParallelPlan = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class PipelineLayout:
    """The module that pipelines (``module``: its name, ``""`` for the one returning the plan) and, among its
    children, what the first stage holds (``inputs``), the container of repeated blocks (``blocks``) and what the
    last stage holds (``outputs``). Its other children must hold no parameters (they stay on every stage).
    ``positions``: the keyword by which its ``forward`` takes the rows' positions ([rows, seq] integers; None: it
    takes none), which the pipeline gives every stage (``0 .. seq - 1`` where the caller gives none)."""

    module: str
    inputs: tuple[str, ...]
    blocks: str
    outputs: tuple[str, ...]
    positions: Optional[str] = None


@dataclass(frozen=True)
class ParallelPlan:
    """How a module splits over tensor-, context-, expert- and pipeline-parallel ranks (the module docstring says
    each field)."""

    tensor_parallel: Optional[TensorParallelPlan] = None
    context_parallel: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    pipeline: Optional[PipelineLayout] = None

    def __post_init__(self) -> None:
        if self.pipeline is not None and not isinstance(self.pipeline, PipelineLayout):
            raise TypeError(f"ParallelPlan.pipeline must be a PipelineLayout; got {type(self.pipeline).__name__}")
        if self.tensor_parallel is not None and not callable(self.tensor_parallel):
            raise TypeError(f"ParallelPlan.tensor_parallel must be a function plan(tp_mesh, *, sequence_parallel,"
                            f" loss_parallel); got {type(self.tensor_parallel).__name__}")
        for field_name in ("context_parallel", "experts"):
            names = getattr(self, field_name)
            if isinstance(names, str) or not all(isinstance(name, str) for name in names):
                raise TypeError(f"ParallelPlan.{field_name} must be a sequence of module names; got {names!r}")
            object.__setattr__(self, field_name, tuple(names))

    def under(self, prefix: str) -> "ParallelPlan":
        """The same plan for a module holding this one's as its submodule ``prefix`` (names prefixed, ``""``
        becoming ``prefix``): how a LightningModule hands on its model's plan."""
        def named(name: str) -> str:
            return f"{prefix}.{name}" if name else prefix

        inner = self.tensor_parallel

        def tensor_parallel(tp_mesh: Any, **flags: Any) -> dict[str, Any]:
            return {named(name): style for name, style in inner(tp_mesh, **flags).items()}

        pipeline = None if self.pipeline is None else dataclasses.replace(self.pipeline,
                                                                          module=named(self.pipeline.module))
        return ParallelPlan(tensor_parallel=None if inner is None else tensor_parallel,
                            context_parallel=tuple(map(named, self.context_parallel)),
                            experts=tuple(map(named, self.experts)), pipeline=pipeline)

    def within(self, prefix: str, part: nn.Module, known: set[str]) -> "ParallelPlan":
        """The plan of ``part``, a pipeline stage of the module this plan calls ``prefix``: the names under
        ``prefix`` relative to it (``prefix`` itself becoming ``""``), but those of ``known`` (the whole model's
        modules, before the split) that ``part`` does not hold (another stage's); names outside ``prefix`` left
        out, the tensor-parallel plan's too. How ``parallelize`` roots the plan at each stage it applies it to (a name that
        is nowhere stays, so applying it fails naming it)."""
        inner = self.tensor_parallel
        held = {name for name, _ in part.named_modules()}

        def relative(names: Iterable[str]) -> list[tuple[str, str]]:
            found = []
            for name in names:
                if not prefix or name == prefix or name.startswith(prefix + "."):
                    inside = name[len(prefix):].lstrip(".") if prefix else name
                    if inside in held or name not in known:
                        found.append((name, inside))
            return found

        def tensor_parallel(tp_mesh: Any, **flags: Any) -> dict[str, Any]:
            styles = inner(tp_mesh, **flags)
            return {inside: styles[name] for name, inside in relative(styles)}

        def kept(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(inside for _, inside in relative(names))

        return ParallelPlan(tensor_parallel=None if inner is None else tensor_parallel,
                            context_parallel=kept(self.context_parallel), experts=kept(self.experts))

    def outside(self, prefix: str) -> "ParallelPlan":
        """The plan's context-parallel modules that do not lie under ``prefix`` (the module that holds a pipeline's
        stages: those outside every stage, such as a LightningModule that shards the batch); nothing else (every
        parameter, so every tensor-parallel entry and every expert, lies in a stage)."""
        return ParallelPlan(context_parallel=tuple(name for name in self.context_parallel
                                                   if prefix and name != prefix and not name.startswith(prefix + ".")))

    def modules(self, root: nn.Module, field_name: str) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` for each module the field ``field_name`` names, found in ``root``."""
        return find_modules(root, getattr(self, field_name), f"ParallelPlan.{field_name}")


def find_modules(root: nn.Module, names: Iterable[str], what: str) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for each of ``names`` in ``root``; ValueError naming the missing ones (``what`` names them)
    and the modules there are."""
    found, missing = [], []
    for name in names:
        try:
            found.append((name, root.get_submodule(name)))
        except AttributeError:
            missing.append(name)
    if missing:
        present = sorted(name for name, _ in root.named_modules() if name)
        raise ValueError(
            f"{what} names {missing}, which {type(root).__name__} does not have; its modules are"
            f" {present[:20]}{' ...' if len(present) > 20 else ''}"
        )
    return found


#: What the strategy's ``parallel_plan`` option holds: a function, its import path, or None.
PlanFunction = Union[str, Callable[[nn.Module], ParallelPlan], None]


def resolve_parallel_plan(spec: PlanFunction) -> Optional[Callable[[nn.Module], ParallelPlan]]:
    """The function ``spec`` names (``"pkg.module.function"`` or ``"pkg.module:function"``), ``spec`` itself if it
    is one, None for None; ValueError otherwise (checked when the strategy is made, before workers start)."""
    if spec is None or callable(spec):
        return spec
    module_name, _, name = str(spec).replace(":", ".").rpartition(".")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"parallel_plan: cannot import {spec!r} ({error}); give the import path of a function plan(module) ->"
            " lightning_npu.parallel.ParallelPlan"
        ) from None
    if not callable(function):
        raise ValueError(f"parallel_plan={spec!r} names an object of type {type(function).__name__}, not a function")
    return function


def plan_of(module: nn.Module, function: Optional[Callable[[nn.Module], ParallelPlan]] = None) -> ParallelPlan:
    """``module``'s plan: ``function(module)`` if given, else its ``parallel_plan()`` method, else an empty plan;
    TypeError if what comes back is no ParallelPlan."""
    if function is None:
        method = getattr(module, "parallel_plan", None)
        if not callable(method):
            return ParallelPlan()
        plan, source = method(), f"{type(module).__name__}.parallel_plan()"
    else:
        plan, source = function(module), f"parallel_plan={getattr(function, '__qualname__', function)!r}"
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"{source} returned {type(plan).__name__}; it must return a lightning_npu.parallel.ParallelPlan")
    return plan


__all__ = ["ParallelPlan", "PipelineLayout", "PlanFunction", "TensorParallelPlan", "find_modules", "plan_of",
           "resolve_parallel_plan"]
