"""``parallelize``: every parallelism applied to a finished model, in order, for the Trainer and Fabric strategies
alike (torchtitan's ``parallelize_llama`` shape): the pipeline split (this rank's stages), tensor parallelism by the
model's plan, context parallelism to the modules it names, the experts (expert parallelism, tensor-parallel shares of
rows), activation checkpointing, then FSDP: the experts, the blocks by policy, the model as the root unit (each stage
as one under pipeline parallelism), and the pipeline's schedule."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_npu.facts import pipeline as pipeline_facts
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.parallel.checkpointing import apply_activation_checkpointing
from lightning_npu.parallel.context import ContextParallel, apply_context_parallel
from lightning_npu.parallel.expert import apply_experts, check_experts, shard_experts
from lightning_npu.parallel.fsdp import apply_fsdp, fully_shard_options, resolve_module_classes, wrap_classes
from lightning_npu.parallel.mesh import ParallelMesh
from lightning_npu.parallel.pipeline import Pipeline, PipelineSplit, check_split, split, tell_split_inputs
from lightning_npu.parallel.protocol import ParallelPlan, PipelineLayout, find_modules
from lightning_npu.parallel.tensor import apply_tensor_parallel, tensor_parallel_parameters
from lightning_npu.precision import mixed_precision_policy


def parallelize(model: nn.Module, mesh: ParallelMesh, options: FSDPOptions, precision: Optional[str],
                plan: ParallelPlan, step_methods: Iterable[str] = (), device: Optional[torch.device] = None
                ) -> Optional[Pipeline]:
    """Split and shard ``model`` over ``mesh`` as ``options`` and its ``plan`` say (the module docstring gives the
    order); ``precision``: the run's precision name (FSDP's mixed-precision policy); ``step_methods``: the model's
    methods that run a step (each gathers the root unit's parameters, like ``forward``). Under pipeline parallelism
    the plan's pipelined module is first pruned to this rank's stages, and the ``Pipeline`` its ``forward`` now runs
    (on ``device``) is returned; None otherwise."""
    # Chosen on the whole model: a pipeline stage may hold none of the blocks, or one.
    ac_classes = resolve_module_classes(options.activation_checkpointing_policy, model, "activation_checkpointing_policy")
    classes, chosen_by = wrap_classes(options.auto_wrap_policy, model)
    order = [name for name, _ in model.named_parameters()]  # the whole model's, before a pipeline split
    experts = plan.modules(model, "experts")  # the plan's names checked against the whole model
    split_ = None
    if mesh.pp is not None:
        before = {name for name, _ in model.named_modules()}
        split_ = _split(model, mesh, options, plan)
        plan = plan.without(before - {name for name, _ in model.named_modules()})
        experts = plan.modules(model, "experts")
    check_experts(experts, options.expert_parallel_size)
    if mesh.tp is not None:
        _tensor_parallel(model, mesh, options, plan, experts)
        if split_ is not None and options.sequence_parallel:
            tell_split_inputs(split_, mesh.layout.tp)
    if mesh.cp is not None:
        _context_parallel(model, mesh, options, plan, split_)
    experts_apart = bool(experts) and (options.expert_parallel_size > 1 or mesh.tp is not None)
    if experts_apart:
        ep_mesh = mesh.experts["ep"] if options.expert_parallel_size > 1 else None
        apply_experts(experts, ep_mesh, None if mesh.tp is None else mesh.tp.get_group())
        ep, tp = options.expert_parallel_size, mesh.layout.tp
        split = f"expert parallelism over {ep} ranks: the experts of {len(experts)} modules split" if ep > 1 else (
            f"the experts of {len(experts)} modules")
        rows = f"; each of {tp} tensor-parallel ranks runs a share of their rows" if tp > 1 else ""
        rank_zero_info(f"npu_fsdp: {split}{rows}")
    checkpointed = apply_activation_checkpointing(model, ac_classes, float(options.activation_checkpointing_ratio))
    policy = mixed_precision_policy(precision)
    if experts_apart:
        # Under a pipeline the experts' units stay gathered for the step, as the stages' (see the stages below).
        shard_experts(experts, mesh.expert_fsdp, mesh.layout.loss_ranks,
                      reshard_after_forward=options.reshard_after_forward and split_ is None,
                      **fully_shard_options(mesh.expert_fsdp, policy, options.cpu_offload))
    shard = dict(wrap_classes=classes, mp_policy=policy, cpu_offload=options.cpu_offload, scalar_group=mesh.loss_group)
    if split_ is None:
        sharded = apply_fsdp(model, mesh.fsdp, reshard_after_forward=options.reshard_after_forward,
                             step_methods=step_methods, **shard)
    else:
        # Each stage is a unit of its own (the root the schedule calls), its blocks kept gathered for the whole step
        # (see parallel.pipeline: one all-gather per unit per step; the zero-bubble schedules need it).
        sharded = [name for stage in split_.stages.values()
                   for name in apply_fsdp(stage, mesh.fsdp, reshard_after_forward=False, **shard)]
        if device is not None:
            # FSDP moves what its units hold; buffers outside every stage (on the LightningModule itself, or
            # parameter-free modules beside the pipelined one) would stay where they were built.
            move_buffers(model, device)
    rank_zero_info(f"npu_fsdp: {len(sharded)} FSDP units ({chosen_by}; zero_stage={options.zero_stage},"
                   f" sharding={options.sharding!r}), activation checkpointing on {len(checkpointed)} modules")
    if split_ is None:
        return None
    pipeline = Pipeline(split_, options.pipeline_schedule, options.microbatches, mesh.pp.get_group(), device,
                        options.stages_per_rank, parameter_order=order,
                        sequence_group=None if mesh.cp is None else mesh.cp.get_group())
    pipeline.install()
    return pipeline


def check_pipeline(model: nn.Module, options: FSDPOptions, plan: ParallelPlan) -> tuple[nn.Module, PipelineLayout]:
    """Whether ``model`` splits into the stages ``options`` ask for as its ``plan`` says: the plan's pipelined module
    and its layout relative to it, or ValueError / TypeError with the value, the reason and the fix. npu_fsdp runs it
    before workers start where the model exists by then (built outside ``configure_model``), and on every rank
    before the split."""
    layout = plan.pipeline
    if layout is None:
        raise ValueError(
            f"pipeline_parallel_size={options.pipeline_parallel_size}, but the model's ParallelPlan names no pipeline:"
            " give ParallelPlan(pipeline=PipelineLayout(module, inputs, blocks, outputs)) for the module to split (see"
            " lightning_npu.parallel.protocol), or train without pipeline parallelism"
        )
    ((_, module),) = find_modules(model, [layout.module], "ParallelPlan.pipeline")
    inside = {id(param) for param in module.parameters()}
    outside = [name for name, param in model.named_parameters() if id(param) not in inside]
    if outside:
        raise ValueError(
            f"under pipeline parallelism every parameter belongs to a stage of {layout.module or 'the model'};"
            f" {outside[:5]} lie outside it: move them into its parts (inputs, blocks or outputs)"
        )
    layout = dataclasses.replace(layout, module="")
    check_split(module, layout, options.pipeline_parallel_size * options.stages_per_rank,
                options.pipeline_layers_per_stage, options.pipeline_schedule)
    return module, layout


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer of ``model`` that is not on ``device`` (nor on the meta device, which the first values fill)
    moved there; registered buffers stay registered."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                setattr(module, name, buffer.to(device))


def _split(model: nn.Module, mesh: ParallelMesh, options: FSDPOptions, plan: ParallelPlan) -> PipelineSplit:
    """Prune the plan's pipelined module to this rank's stages (``parallel.pipeline.split``)."""
    module, layout = check_pipeline(model, options, plan)
    per_rank = options.stages_per_rank
    pp, pp_rank = mesh.layout.pp, mesh.pp.get_local_rank()
    stage_ids = pipeline_facts.stage_ids(options.pipeline_schedule, pp_rank, pp, per_rank)
    split_ = split(module, layout, stage_ids, pp * per_rank, options.pipeline_layers_per_stage,
                   options.pipeline_schedule)
    held = [f"{stage}: {split_.blocks[stage]}" for stage in stage_ids]
    rank_zero_info(f"npu_fsdp: pipeline ({options.pipeline_schedule}, {options.microbatches} microbatches) over"
                   f" {pp * per_rank} stages; rank 0 runs stage(s) {', '.join(held)}")
    return split_


def _tensor_parallel(model: nn.Module, mesh: ParallelMesh, options: FSDPOptions, plan: ParallelPlan,
                     experts: list[tuple[str, nn.Module]]) -> None:
    planned = []
    if plan.tensor_parallel is not None:
        planned = apply_tensor_parallel(model, mesh.tp, plan.tensor_parallel, sequence_parallel=options.sequence_parallel,
                                        loss_parallel=options.loss_parallel, experts=experts)
    split = tensor_parallel_parameters(model)
    if not split:
        rank_zero_warn(
            f"npu_fsdp: tensor_parallel_size={mesh.layout.tp}, but no parameter is split over the tensor-parallel"
            " ranks, so each group of them computes the whole model on the same batch (correct results, no memory"
            " saved). Give the model a parallel_plan() returning ParallelPlan(tensor_parallel=...) (or the"
            " strategy's parallel_plan option), or shard it with parallelize_module on"
            " self.device_mesh['tensor_parallel'] in configure_model."
        )
    rank_zero_info(f"npu_fsdp: tensor parallelism over {mesh.layout.tp} ranks: {len(split)} parameters split"
                   f"{' (plan: ' + ', '.join(planned) + ')' if planned else ''}")


def _context_parallel(model: nn.Module, mesh: ParallelMesh, options: FSDPOptions, plan: ParallelPlan,
                      split_: Optional[PipelineSplit]) -> None:
    context_parallel = ContextParallel(mesh.cp.get_group(), options.context_parallel_algo)
    given = apply_context_parallel(model, plan.context_parallel, context_parallel)
    if split_ is not None and getattr(split_.module, "context_parallel", None) is context_parallel:
        for view in split_.stages.values():  # shallow copies of the pipelined module, made before it got it
            view.context_parallel = context_parallel
    if not given:
        rank_zero_warn(
            f"npu_fsdp: context_parallel_size={mesh.layout.cp}, but the model's ParallelPlan names no"
            " context_parallel modules, so nothing splits the sequence: each group of context-parallel ranks computes"
            " the whole sequence of the same batch (correct results, no memory saved). Name the modules that shard"
            " the batch (ContextParallel.shard) and run attention (ContextParallel.attention); see"
            " lightning_npu.parallel.context."
        )
    rank_zero_info(f"npu_fsdp: context parallelism ({options.context_parallel_algo}) over {mesh.layout.cp} ranks:"
                   f" {len(given)} modules split the sequence")


__all__ = ["check_pipeline", "move_buffers", "parallelize"]
