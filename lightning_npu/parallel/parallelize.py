"""``parallelize``: every parallelism applied to a finished model, in order, for the Trainer and Fabric strategies
alike (torchtitan's ``pipeline_llm`` / ``parallelize_llama`` shape). The model is split into its parts first:
``[model]``, or under pipeline parallelism this rank's stages, each a module of its own. Then, to each part with the
plan's names rooted at it: tensor parallelism by the model's plan, context parallelism to the modules it names, the
experts (expert parallelism, tensor-parallel shares of rows), activation checkpointing, then FSDP: the experts, the
blocks by policy, the part as the root unit. Under pipeline parallelism the pipeline's schedule runs the stages.
What comes back is one handle, ``ParallelModel``: the parts, the schedule, the ``StateLayout`` the checkpoints
read."""

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
from lightning_npu.parallel.fsdp import (apply_fsdp, fully_shard_options, move_buffers, resolve_module_classes,
                                        wrap_classes)
from lightning_npu.parallel.handle import ParallelModel, StateLayout
from lightning_npu.parallel.mesh import ParallelMesh
from lightning_npu.parallel.pipeline import Pipeline, PipelineSplit, check_split, split
from lightning_npu.parallel.protocol import ParallelPlan, PipelineLayout, find_modules
from lightning_npu.parallel.tensor import apply_tensor_parallel, tensor_parallel_parameters
from lightning_npu.precision import mixed_precision_policy


def parallelize(model: nn.Module, mesh: ParallelMesh, options: FSDPOptions, precision: Optional[str],
                plan: ParallelPlan, step_methods: Iterable[str] = (), device: Optional[torch.device] = None
                ) -> ParallelModel:
    """Split and shard ``model`` over ``mesh`` as ``options`` and its ``plan`` say (the module docstring gives the
    order); ``precision``: the run's precision name (FSDP's mixed-precision policy); ``step_methods``: the model's
    methods that run a step (each gathers the root unit's parameters, like ``forward``). The model is split into
    its parts first: ``[model]``, or under pipeline parallelism this rank's stages of the plan's pipelined module
    (pruned to them; its ``forward`` then runs the schedule, on ``device``). Every parallelism is then applied to
    each part, with the plan's names rooted at it."""
    # Chosen on the whole model: a pipeline stage may hold none of the blocks, or one.
    ac_classes = resolve_module_classes(options.activation_checkpointing_policy, model, "activation_checkpointing_policy")
    classes, chosen_by = wrap_classes(options.auto_wrap_policy, model)
    order = tuple(name for name, _ in model.named_parameters())  # the whole model's, before a pipeline split
    # Split first: the parts every parallelism below is applied to, each with the plan rooted at it, and the plan
    # of what holds them (under a pipeline: the context-parallel modules outside every stage).
    if mesh.pp is None:
        split_, parts, holder_plan = None, [(model, plan)], ParallelPlan()
    else:
        split_, parts, holder_plan = _split(model, mesh, options, plan)
    experts = [found for part, part_plan in parts for found in part_plan.modules(part, "experts")]
    check_experts(experts, options.expert_parallel_size)
    if mesh.tp is not None:
        _tensor_parallel(parts, mesh, options, experts)
    if mesh.cp is not None:
        _context_parallel(model, holder_plan, parts, mesh, options)
    experts_apart = bool(experts) and (options.expert_parallel_size > 1 or mesh.tp is not None)
    if experts_apart:
        ep_mesh = mesh.experts["ep"] if options.expert_parallel_size > 1 else None
        apply_experts(experts, ep_mesh, None if mesh.tp is None else mesh.tp.get_group())
        ep, tp = options.expert_parallel_size, mesh.layout.tp
        split = f"expert parallelism over {ep} ranks: the experts of {len(experts)} modules split" if ep > 1 else (
            f"the experts of {len(experts)} modules")
        rows = f"; each of {tp} tensor-parallel ranks runs a share of their rows" if tp > 1 else ""
        rank_zero_info(f"npu_fsdp: {split}{rows}")
    checkpointed = apply_activation_checkpointing([part for part, _ in parts], ac_classes,
                                                  float(options.activation_checkpointing_ratio))
    policy = mixed_precision_policy(precision)
    if experts_apart:
        # Under a pipeline the experts' units stay gathered for the step, as the stages' (see the stages below).
        shard_experts(experts, mesh.expert_fsdp, mesh.layout.loss_ranks,
                      reshard_after_forward=options.reshard_after_forward and split_ is None,
                      **fully_shard_options(mesh.expert_fsdp, policy, options.cpu_offload))
    shard = dict(wrap_classes=classes, mp_policy=policy, cpu_offload=options.cpu_offload, scalar_group=mesh.loss_group)
    # Without a pipeline the model is the root unit; under one each stage is a unit of its own (the root the
    # schedule calls), its blocks kept gathered for the whole step (see parallel.pipeline: one all-gather per unit
    # per step; the zero-bubble schedules need it).
    reshard_after_forward = options.reshard_after_forward and split_ is None
    sharded = [name for part, _ in parts
               for name in apply_fsdp(part, mesh.fsdp, reshard_after_forward=reshard_after_forward,
                                      step_methods=step_methods if split_ is None else (), **shard)]
    if split_ is not None and device is not None:
        move_buffers(model, device)  # those outside every stage, which no unit holds
    rank_zero_info(f"npu_fsdp: {len(sharded)} FSDP units ({chosen_by}; zero_stage={options.zero_stage},"
                   f" sharding={options.sharding!r}), activation checkpointing on {len(checkpointed)} modules")
    if split_ is None:
        return ParallelModel((model,), None, StateLayout(order, device=device))
    pipeline = Pipeline(split_, options.pipeline_schedule, options.microbatches, mesh.pp.get_group(), device,
                        options.stages_per_rank, sequence_group=None if mesh.cp is None else mesh.cp.get_group())
    pipeline.install()
    return ParallelModel(tuple(split_.stages[index] for index in sorted(split_.stages)), pipeline,
                         StateLayout(order, mesh.pp.get_group(), device))


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


def _split(model: nn.Module, mesh: ParallelMesh, options: FSDPOptions, plan: ParallelPlan
           ) -> tuple[PipelineSplit, list[tuple[nn.Module, ParallelPlan]], ParallelPlan]:
    """Prune the plan's pipelined module to this rank's stages (``parallel.pipeline.split``): the split, each stage
    with the plan rooted at it, and the plan of the modules outside every stage (``ParallelPlan.outside``)."""
    module, layout = check_pipeline(model, options, plan)
    known = {name for name, _ in model.named_modules()}
    per_rank = options.stages_per_rank
    pp, pp_rank = mesh.layout.pp, mesh.pp.get_local_rank()
    stage_ids = pipeline_facts.stage_ids(options.pipeline_schedule, pp_rank, pp, per_rank)
    split_ = split(module, layout, stage_ids, pp * per_rank, options.pipeline_layers_per_stage,
                   options.pipeline_schedule)
    held = [f"{stage}: {split_.blocks[stage]}" for stage in stage_ids]
    rank_zero_info(f"npu_fsdp: pipeline ({options.pipeline_schedule}, {options.microbatches} microbatches) over"
                   f" {pp * per_rank} stages; rank 0 runs stage(s) {', '.join(held)}")
    prefix = plan.pipeline.module
    parts = [(split_.stages[stage], plan.within(prefix, split_.stages[stage], known)) for stage in sorted(split_.stages)]
    return split_, parts, plan.outside(prefix)


def _tensor_parallel(parts: list[tuple[nn.Module, ParallelPlan]], mesh: ParallelMesh, options: FSDPOptions,
                     experts: list[tuple[str, nn.Module]]) -> None:
    planned = [name for part, plan in parts if plan.tensor_parallel is not None
               for name in apply_tensor_parallel(part, mesh.tp, plan.tensor_parallel,
                                                 sequence_parallel=options.sequence_parallel,
                                                 loss_parallel=options.loss_parallel, experts=experts)]
    split = [name for part, _ in parts for name in tensor_parallel_parameters(part)]
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


def _context_parallel(model: nn.Module, holder_plan: ParallelPlan, parts: list[tuple[nn.Module, ParallelPlan]],
                      mesh: ParallelMesh, options: FSDPOptions) -> None:
    """Context parallelism given to the modules each part's plan names, and to those of ``holder_plan`` in
    ``model`` (under a pipeline: the modules outside every stage, such as the one that shards the batch)."""
    context_parallel = ContextParallel(mesh.cp.get_group(), options.context_parallel_algo)
    given = apply_context_parallel(model, holder_plan.context_parallel, context_parallel)
    given += [name for part, plan in parts for name in apply_context_parallel(part, plan.context_parallel,
                                                                              context_parallel)]
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


__all__ = ["check_pipeline", "parallelize"]
