"""The pipelined replay: one training step of each pipeline rank, as its schedule runs it (``facts.pipeline.actions``:
torch 2.13's order of forwards and backwards per microbatch and stage), on the FSDP2 replay's timeline
(``replay._StepReplay``), with what npu_fsdp does under pipeline parallelism:

- a rank holds its stages' blocks, the first stage the embedding, the last the final norm and head; each unit is
  sharded over the ranks of its stage (``PlanSpec.shard_group``: ``dp_shard x cp``);
- every unit is all-gathered at its stage's first forward and stays gathered until its last backward
  (``reshard_after_forward=False``, and torch's stage defers resharding to the last microbatch);
- a unit's unsharded gradients are made by its first backward and accumulated into by the others (upcast to the
  reduce dtype once there is more than one microbatch, as FSDP2 does while gradient sync is off); the last
  backward reduce-scatters them into new gradient shards, held apart from the previous step's until Lightning's
  ``zero_grad`` after the training step;
- each microbatch keeps, from its forward to its backward (to the weight half of it under the zero-bubble
  schedules, with the gradients of the weight matmuls' outputs from the input half on), what its blocks save and
  the stage's output (held for the backward: on the last stage the fp32 logits, beside the final norm's tensors and
  cross-entropy's log-softmax);
- torch allocates every microbatch's receive buffer at the first step and keeps them: the activations a stage
  receives (all but the first stage) and the gradients it receives (all but the last); on a V's last rank, where
  stages p - 1 and p run together, the first hands its output to the second as that buffer (replacing it), so the
  output it holds for its backward is counted once, as the buffer;
- each neighbour the rank sends to holds a point-to-point communicator with two ``P2P_HCCL_BUFFSIZE`` buffers, and
  the loss broadcast and the clipping norm's all-reduce open one over the pipeline ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from lightning_npu.facts import pipeline as schedules
from lightning_npu.facts.options import evenly_spaced
from lightning_npu.plan.replay import (HCCL_BUFFERS_PER_COMMUNICATOR, _StepReplay, _Unit, _unit, _Units, _units,
                                      state_bytes_of)
from lightning_npu.plan.spec import MIB, Estimate, PlanSpec


class _RankReplay(_StepReplay):
    """One step of pipeline rank ``pp_rank``: its schedule's actions, each on ``micro_batch / microbatches``
    samples."""

    def __init__(self, spec: PlanSpec, batch: int, pp_rank: int) -> None:
        pipeline = spec.pipeline
        self.parts = pipeline.parts
        # Each unit stays gathered for the whole step: ZeRO-2's gathering, whatever the configured stage.
        super().__init__(spec, 2, batch // self.parts)
        self.batch_tokens = batch * spec.local_seq_len
        self.pp_rank = pp_rank
        self.stage_ids = schedules.stage_ids(pipeline.schedule, pp_rank, pipeline.size, pipeline.per_rank)
        every = pipeline.stage_blocks(spec.model.n_layers)
        self.stage_blocks = {stage: every[stage] for stage in self.stage_ids}
        # npu_fsdp applies activation checkpointing after the split: the ratio spreads over this rank's blocks.
        held = sorted(i for blocks in self.stage_blocks.values() for i in blocks)
        self.checkpointed = {held[i] for i in evenly_spaced(len(held), spec.ac_ratio)} if spec.ac_ratio else set()
        self.last_stage = pipeline.num_stages - 1
        #: The stages whose next stage runs on this rank too (a V's middle), which hand it their output directly.
        self.hands_on = {stage for stage in self.stage_ids if stage + 1 in self.stage_ids}
        units, self.train = (_rank_units(spec, self.stage_blocks, self.last_stage, trainable)
                             for trainable in (False, True))
        self.root, self.blocks, self.experts = units.root, units.blocks, units.experts
        self.units = units
        self.train_root, self.train_blocks = self.train.root, self.train.blocks
        self.shard_total = sum(unit.shard for unit in self.train.all)
        #: The end stages this rank holds, whose root unit (embedding, head) is gathered with the first of them and
        #: reduced and resharded after the last backward of the last of them.
        self.ends = {stage for stage in self.stage_ids if stage in (0, self.last_stage)}
        self.ends_open = set(self.ends)
        self.root_gathered = self.root_upcast = False
        #: The new gradient shards this step's reduce-scatters made (beside the previous step's until released).
        self.step_gradients = 0.0
        # The accumulated unsharded gradients' bytes per element: FSDP2 upcasts them to the reduce dtype between
        # microbatches while gradient sync is off.
        self.accumulated = self.reduced if self.parts > 1 else self.param

    def run(self) -> Estimate:
        self.persistent_state()
        self.pipeline_buffers()
        started: set[int] = set()
        backwards = {stage: 0 for stage in self.stage_ids}
        for action in schedules.actions(self.spec.pipeline.schedule, self.pp_rank, self.spec.pipeline.size,
                                        self.parts, self.spec.pipeline.per_rank):
            if action.kind == "F":
                self.stage_forward(action.stage, action.microbatch, gather=action.stage not in started)
                started.add(action.stage)
            elif action.kind == "I":  # the input half: the gradients its matmuls' outputs got wait for the weights'
                self.timeline.alloc("activations", self.weight_pass_grads(action.stage),
                                    f"backward (input): stage {action.stage} microbatch {action.microbatch}")
            else:
                backwards[action.stage] += 1
                self.stage_backward(action.stage, action.microbatch, first=backwards[action.stage] == 1,
                                    last=backwards[action.stage] == self.parts)
                if action.kind == "W":
                    self.timeline.free("activations", self.weight_pass_grads(action.stage))
        self.release_gradients()
        self.optimizer_step()
        return self.result()

    def persistent_state(self) -> None:
        """The rank's shards, gradients and optimizer states, the batch every pipeline rank loads, HCCL's buffers."""
        super().persistent_state()
        t, spec = self.timeline, self.spec
        t.free("inputs", self.inputs_bytes(self.tokens))
        t.alloc("inputs", self.inputs_bytes(self.batch_tokens), "start")
        pipeline = spec.pipeline
        neighbours = len({_neighbour(stage + step, pipeline) for stage in self.stage_ids for step in (-1, 1)
                          if 0 <= stage + step < pipeline.num_stages} - {self.pp_rank})
        p2p = neighbours * HCCL_BUFFERS_PER_COMMUNICATOR * spec.p2p_buffsize_mb * MIB
        pp_group = HCCL_BUFFERS_PER_COMMUNICATOR * spec.hccl_buffsize_mb * MIB  # the loss broadcast, the clip norm
        t.alloc("comm", p2p + pp_group, "start")

    def state(self) -> dict[str, float]:
        return state_bytes_of(self.spec, self.units, self.train)

    def pipeline_buffers(self) -> None:
        """The receive buffers torch keeps for every microbatch (see the module docstring)."""
        for stage in self.stage_ids:
            received = (stage > 0) + (stage < self.last_stage)
            self.timeline.alloc("pipeline", received * self.parts * self.stage_io, "start: receive buffers")

    @property
    def stage_io(self) -> float:
        """A microbatch's activations (or their gradients) between two stages: the residual stream [samples, seq,
        dim], split by sequence over the tensor-parallel ranks under sequence parallelism."""
        return self.residual

    def weight_pass_grads(self, stage: int) -> float:
        """What the zero-bubble schedules' input pass leaves for the weight pass: the gradient of each weight
        matmul's output ([tokens, out features] per matrix of the stage's blocks)."""
        rows = sum(shape[0] for i in self.stage_blocks[stage]
                   for shape in self.layers[i].trainable_parameters().block.shapes if len(shape) == 2)
        return rows * self.tokens * self.act

    def stage_forward(self, stage: int, microbatch: int, gather: bool) -> None:
        t = self.timeline
        phase = f"forward: stage {stage} microbatch {microbatch}"
        if gather and stage in self.ends and not self.root_gathered:
            self.gather(self.root, phase + " root")
            self.root_gathered = True
        t.alloc("temporaries", self.residual, phase)  # the residual stream
        for i in self.stage_blocks[stage]:
            self.block_forward(i, f"{phase} layer {i}", gather=gather)
        t.free("gathered", self.retained_gather)
        self.retained_gather = 0.0
        if stage == self.last_stage:
            self.loss_forward(phase)
            t.alloc("logits", self.logits_fp32, phase + " logits held")  # the stage's output, kept for its backward
        else:  # the stage's output, sent on and held for the backward
            if stage not in self.hands_on:  # (handed on, it replaces the next stage's receive buffer: counted there)
                t.alloc("activations", self.stage_io, phase + " output")
            t.free("temporaries", self.residual)

    def stage_backward(self, stage: int, microbatch: int, first: bool, last: bool) -> None:
        """A whole backward (or the weights' half, with the input's, under the zero-bubble schedules): ``first`` /
        ``last``: the stage's first / last of the step."""
        t = self.timeline
        phase = f"backward: stage {stage} microbatch {microbatch}"
        if stage == self.last_stage:
            self.loss_backward(head_grads=first)
            t.free("logits", self.logits_fp32)
        else:
            t.alloc("temporaries", self.residual, phase)  # the received gradient flows back as the stream's
            if stage not in self.hands_on:
                t.free("activations", self.stage_io)
        for i in reversed(self.stage_blocks[stage]):
            self.block_backward(i, f"{phase} layer {i}", new_grads=first, last=last)
        if stage == 0:
            self.gradient("unsharded_grads", self.trainable.embedding * self.param, phase + " embedding", first)
        t.free("temporaries", self.residual)
        upcast = self.accumulated - self.param
        if first and upcast and not last:  # the stage's gradients, and the root's with its first end stage
            numel = sum(self.train_blocks[i].exact + (self.train.experts[i].exact if self.train.experts[i] else 0)
                        for i in self.stage_blocks[stage])
            if stage in self.ends and not self.root_upcast:
                numel += self.train_root.exact
                self.root_upcast = True
            t.alloc("unsharded_grads", numel * upcast, phase + " upcast")
        if last:
            self.ends_open.discard(stage)
            if stage in self.ends and not self.ends_open:  # the root unit's last backward
                self.reduce(self.train_root, phase + " root reduce-scatter")
                t.free("gathered", self.gathered_bytes(self.root))
            t.free("unsharded_grads", self.retained_reduce)
            self.retained_reduce = 0.0

    @property
    def unsharded_grad_bytes(self) -> float:
        """Accumulated over the microbatches at the reduce dtype's width (see the module docstring)."""
        return self.accumulated

    def keep_reduced(self, unit: _Unit, phase: str) -> None:
        """The step's gradient shards are new, beside the previous step's until released (or on the host)."""
        if self.spec.cpu_offload:
            self.timeline.moment("unsharded_grads", unit.shard * self.reduced, phase)
        else:
            self.timeline.alloc("gradients", unit.shard * self.master, phase)
            self.step_gradients += unit.shard * self.master

    def release_gradients(self) -> None:
        """The loss's backward hands the step's shards over: Lightning's ``zero_grad`` after the training step drops
        the previous step's, or, while gradients accumulate, the step's are added into them and dropped."""
        if self.spec.cpu_offload:
            return
        if self.spec.accumulate_grad_batches == 1:
            self.timeline.free("gradients", self.gradients)
            self.gradients = self.step_gradients
        else:
            self.timeline.free("gradients", self.step_gradients)


def _rank_units(spec: PlanSpec, stage_blocks: dict[int, list[int]], last_stage: int, trainable: bool) -> _Units:
    """The FSDP units of a rank's stages: their blocks (the others' are empty) and one root of the embedding (first
    stage) and the final norm and head (last stage). npu_fsdp wraps each block of a stage by its policy, or the
    block it infers, so the blocks are units whatever ``wrap_blocks`` says."""
    held = {i for blocks in stage_blocks.values() for i in blocks}
    units = _units(dataclasses.replace(spec, wrap_blocks=True), trainable)
    empty = _unit("block", [], spec.shard_group)
    blocks = [unit if i in held else empty for i, unit in enumerate(units.blocks)]
    experts = [unit if i in held else None for i, unit in enumerate(units.experts)]
    profile = spec.profile
    root = profile.root_parameters()
    shapes = []
    if not trainable or profile.trainable_parameters().root:
        shapes = ([root.embedding] if 0 in stage_blocks else []) + (
            [root.final_norm, root.output] if last_stage in stage_blocks else [])
    return _Units(_unit("root", shapes, spec.shard_group), blocks, experts)


def _neighbour(stage: int, pipeline) -> int:
    """The pipeline rank that runs ``stage``."""
    for rank in range(pipeline.size):
        if stage in schedules.stage_ids(pipeline.schedule, rank, pipeline.size, pipeline.per_rank):
            return rank
    raise AssertionError(stage)


def estimate_ranks(spec: PlanSpec, micro_batch: Optional[int] = None) -> list[Estimate]:
    """Each pipeline rank's peak of one steady-state step (its stages, its schedule's order)."""
    batch = spec.micro_batch if micro_batch is None else micro_batch
    return [_RankReplay(spec, batch, rank).run() for rank in range(spec.pipeline.size)]
