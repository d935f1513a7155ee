"""Pipeline parallelism on ``torch.distributed.pipelining``: a model's stages over the ``pp`` ranks, and one call that
runs a schedule.

The model says how it splits (``ParallelPlan.pipeline``, a ``PipelineLayout``: its inputs, blocks and outputs;
the contract is in ``lightning_npu.parallel.protocol``). This module:

- splits it (:func:`split`): the model is pruned **in place** to this rank's stages: the parts no local stage holds
  become ``None`` and the blocks container keeps the local blocks under their original indices (``KeptBlocks``), so
  every parameter keeps its name (``layers.5.attention.wq.weight``) and optimizer states and checkpoints are keyed as
  without PP: a sharded checkpoint saved under one layout loads under another. Each stage is a module of its own,
  made here before anything else is applied (a shallow copy of the pruned model with its own children and hook
  dicts, sharing the submodules): ``parallelize`` applies every parallelism to each stage, FSDP included (the unit
  the schedule runs), and the model's own ``forward`` is then free to become the pipeline (:meth:`Pipeline.install`);
- runs a step (:class:`Pipeline`): the schedule (``scale_grads=False``) over the microbatches, the loss normalised
  by the batch's labelled tokens (the mean the unpipelined model gives, however unevenly labels fall on the
  microbatches), the step's loss broadcast from the rank holding the last stage to every rank of the pipeline. The
  returned loss is differentiable: the schedule has run every backward already, and the loss's own backward adds the
  step's gradients to ``.grad``, times what it brings (Lightning's ``1 / accumulate_grad_batches``, a loss scale),
  so code written for an unpipelined model (``loss.backward()``, ``zero_grad`` between forward and backward, a
  scaled loss) gets the gradients it would get. ``eval`` (forward only) for validation; called without labels
  under ``no_grad`` (``predict_step``), the model gives the last stage's outputs, broadcast to every rank of the
  pipeline (:meth:`Pipeline.outputs`). Every microbatch must have
  the shapes of the first (torch infers its P2P buffers from microbatch 0): an uneven split is refused in training
  on every rank before any exchange (evaluation pads the batch with unlabelled rows), and a new shape builds the
  schedule again, which infers the shapes again. Every stage gets the rows' positions as an input
  (``PipelineLayout.positions``): under sequence parallelism a later stage receives a part of each sequence, and
  under context parallelism every stage holds a part, so none of them can tell the positions from its input;
- leaves the point-to-point exchanges to torch's schedules, whose mixed send/receive batches hold at most one task of
  each kind per peer: HCCL's rule (``facts.hccl``), which the strict fake enforces and the launched runs check.

Measured on gloo (tests/parallel/test_pipeline.py): every schedule gives the unpipelined model's losses and gradients; FSDP2
under PP: torch turns gradient sync off for every microbatch and reduce-scatters once per unit per step, so each
stage's unsharded gradients live for the whole step; its blocks keep their parameters gathered from forward to
the end of the step (``reshard_after_forward=False``, torchtitan's choice under PP: one all-gather per unit per step
instead of one per microbatch and stage visit), and the zero-bubble schedules need it (with resharding torch 2.13
computes wrong weight gradients, silently).
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_npu import compat
from lightning_npu.facts import pipeline as facts
from lightning_npu.parallel.fsdp import reshard
from lightning_npu.parallel.protocol import PipelineLayout
from lightning_npu.parallel.tensor import local_tensor

#: The label that marks a token without loss (prompts, padding), as in ``torch.nn.functional.cross_entropy``.
IGNORE_INDEX = -100

_INFERRING = threading.local()


def inferring_shapes() -> bool:
    """Whether this thread runs a stage's forward only for torch to infer what the stage sends (once per schedule,
    at its first step, with microbatch 0): a forward that is no training step, whose side effects (counters a
    training forward updates, such as an MoE layer's routed tokens) must not count."""
    return getattr(_INFERRING, "active", False)


@contextmanager
def _inferring() -> Iterator[None]:
    _INFERRING.active = True
    try:
        yield
    finally:
        _INFERRING.active = False


class KeptBlocks(nn.Module):
    """The blocks of a ``ModuleList`` a rank keeps, named by their original indices, so their parameters keep their
    names (``layers.5.weight``). Iterates like the list; ``named_children`` gives the original indices."""

    def __init__(self, blocks: Mapping[int, nn.Module]) -> None:
        super().__init__()
        for index, block in sorted(blocks.items()):
            self.add_module(str(index), block)

    def __iter__(self) -> Iterator[nn.Module]:
        return self.children()

    def __len__(self) -> int:
        return sum(1 for _ in self.children())

    def __getitem__(self, index: int) -> nn.Module:
        return self.get_submodule(str(index))


@dataclass
class PipelineSplit:
    """What :func:`split` made: ``module`` pruned to this rank's stages, ``stages`` each local stage's module by
    stage index, of ``num_stages``, the blocks of every stage (``blocks[s]``), and the keyword of the rows'
    positions (``PipelineLayout.positions``)."""

    module: nn.Module
    stages: dict[int, nn.Module]
    num_stages: int
    blocks: list[list[int]]
    positions: Optional[str] = None


def split(module: nn.Module, layout: PipelineLayout, stage_ids: Sequence[int], num_stages: int,
          layers_per_stage: Optional[Sequence[int]] = None, schedule: str = facts.DEFAULT_SCHEDULE) -> PipelineSplit:
    """Prune ``module`` in place to the stages ``stage_ids`` of ``num_stages`` (see the module docstring), each holding
    the blocks ``facts.blocks_per_stage`` gives for ``schedule`` (``layers_per_stage``: their counts); ValueError or
    TypeError naming what does not fit the layout (:func:`check_split`)."""
    blocks = check_split(module, layout, num_stages, layers_per_stage, schedule)
    container = getattr(module, layout.blocks)

    def parts(stage: int) -> set[str]:
        return (set(layout.inputs) if stage == 0 else set()) | (set(layout.outputs) if stage == num_stages - 1 else set())

    kept = set().union(*(parts(stage) for stage in stage_ids))
    for name in (*layout.inputs, *layout.outputs):
        if name not in kept:
            setattr(module, name, None)
    indices = sorted(index for stage in stage_ids for index in blocks[stage])
    setattr(module, layout.blocks, KeptBlocks({index: container[index] for index in indices}))
    stages = {stage: _view(module, parts(stage), layout, blocks[stage]) for stage in stage_ids}
    return PipelineSplit(module, stages, num_stages, blocks, layout.positions)


_CONTRACT = "see 'Pipeline parallelism' in docs/parallelism.md"


def check_split(module: nn.Module, layout: PipelineLayout, num_stages: int,
                layers_per_stage: Optional[Sequence[int]] = None, schedule: str = facts.DEFAULT_SCHEDULE
                ) -> list[list[int]]:
    """Whether ``module`` (the layout's pipelined module) splits into ``num_stages`` stages as ``layout`` says,
    without changing it: the blocks of every stage (``facts.blocks_per_stage``), or ValueError / TypeError naming the
    value, why it cannot split and the fix. Run before workers start where the model exists by then, and by
    :func:`split` on every rank."""
    name = type(module).__name__
    loss = getattr(module, "loss", None)
    if not callable(loss):
        raise TypeError(f"{name} has no loss(output, labels, reduction) method: under pipeline parallelism only the"
                        " last stage sees the output, and it computes the loss by calling it; define it (and make"
                        f" forward(x, labels=labels) return it), {_CONTRACT}")
    try:
        inspect.signature(loss).bind(None, None, reduction="sum")
    except TypeError as error:
        raise TypeError(f"{name}.loss{inspect.signature(loss)} cannot be called as loss(output, labels,"
                        f" reduction='sum') ({error}): the last stage sums each microbatch's loss and divides by the"
                        " batch's labelled count, so the mean is the unpipelined one however labels fall on the"
                        " microbatches; give loss a reduction argument ('mean' | 'sum', as torch.nn.functional's"
                        " losses take)") from None
    children = dict(module.named_children())
    missing = [part for part in (*layout.inputs, layout.blocks, *layout.outputs) if part not in children]
    if missing:
        raise ValueError(f"the pipeline layout names {missing}, which {name} has no child called; its children are"
                         f" {sorted(children)}; name the parts among its children, or give the module that holds"
                         " them as PipelineLayout.module")
    container = children[layout.blocks]
    if not isinstance(container, nn.ModuleList):
        raise TypeError(f"the pipeline's blocks ({name}.{layout.blocks}) are a {type(container).__name__}: each stage"
                        " keeps some of them under their indices; make them an nn.ModuleList that forward loops over"
                        " (for block in self.blocks: x = block(x))")
    own = [param_name for param_name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(f"{name} holds parameters of its own ({own}): under pipeline parallelism each parameter"
                         " belongs to one stage's part (an input, a block or an output); move them into a part (a"
                         " positional table into the input module that uses it)")
    named = {*layout.inputs, layout.blocks, *layout.outputs}
    holding = [child for child, value in children.items()
               if child not in named and value is not None and any(True for _ in value.parameters())]
    if holding:
        raise ValueError(f"{holding} hold parameters but are in no part of the pipeline layout: only"
                         " parameter-free children can stay on every stage; add them to the layout's inputs or"
                         " outputs")
    blocks = facts.blocks_per_stage(len(container), num_stages, schedule=schedule, layers_per_stage=layers_per_stage)
    _check_untied(module, layout, blocks)
    return blocks


def _check_untied(module: nn.Module, layout: PipelineLayout, blocks: Sequence[Sequence[int]]) -> None:
    """A parameter shared by parts on two stages (an embedding tied to the head) would be two copies after the split,
    each stepped with its own stage's gradient only: refused, naming both."""
    container = getattr(module, layout.blocks)
    where: dict[int, tuple[int, str]] = {}
    parts = [(0, part, getattr(module, part)) for part in layout.inputs]
    parts += [(stage, f"{layout.blocks}.{index}", container[index])
              for stage, indices in enumerate(blocks) for index in indices]
    parts += [(len(blocks) - 1, part, getattr(module, part)) for part in layout.outputs]
    for stage, part, owner in parts:
        for param_name, param in owner.named_parameters():
            first = where.setdefault(id(param), (stage, f"{part}.{param_name}"))
            if first[0] != stage:
                raise ValueError(
                    f"{type(module).__name__}.{first[1]} (stage {first[0]}) and .{part}.{param_name} (stage {stage})"
                    " are one parameter, which two stages would hold as two copies, each trained by its own"
                    " stage's gradient; make them two parameters (e.g. tie_embeddings off) or keep both parts on one"
                    " stage"
                    " (pipeline_layers_per_stage)"
                )


def _view(module: nn.Module, keep: set[str], layout: PipelineLayout, indices: Sequence[int]) -> nn.Module:
    """The stage's module, made at the split before anything else is applied: a shallow copy of ``module`` holding
    ``keep`` and the blocks ``indices``, its submodules the module's, its dicts (children, parameters, hooks) its
    own. ``parallelize`` then applies every parallelism to it as to a model of its own (what it sets on the stage,
    FSDP's hooks included, stays on the stage); the pruned ``module`` gets nothing but the pipeline's ``forward``."""
    view = copy.copy(module)
    for key, value in list(vars(module).items()):
        if isinstance(value, (dict, set, list)):
            vars(view)[key] = copy.copy(value)
    for name in (*layout.inputs, *layout.outputs):
        if name not in keep:
            setattr(view, name, None)
    container = getattr(module, layout.blocks)
    setattr(view, layout.blocks, KeptBlocks({index: container[index] for index in indices}))
    absent = [name for name in (*layout.inputs, *layout.outputs) if name not in keep]
    if absent:
        view.forward = _absent_parts_explained(view.forward, absent, type(module).__name__)
    return view


def _absent_parts_explained(forward: Any, absent: list[str], name: str) -> Any:
    """``forward`` of a stage lacking the parts ``absent``, whose failure on one of them (None on this stage) says
    so and how to write the forward: Python's own error names neither the part nor the stage."""
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except (TypeError, AttributeError) as error:
            if "'NoneType' object" not in str(error):
                raise
            raise TypeError(
                f"{name}.forward failed on a pipeline stage that does not hold {absent} ({error}), which are None"
                " there as they are on every stage that does not hold them; make forward skip them: take x as the"
                " previous stage's activations where the inputs are None (h = x if self.embed is None else"
                " self.embed(x)), and return the activations where the outputs are None (if self.head is None,"
                f" return h), {_CONTRACT}"
            ) from error

    return run


class _TokenMeanLoss:
    """The schedule's loss of one microbatch: the model's summed loss over its labelled tokens divided by the batch's
    labelled tokens (``tokens``, set before each step), so the gradients the schedule sums over the microbatches are
    those of the batch's token mean. A loss computed on vocabulary-split logits (``loss_parallel``) is the same on
    every tensor-parallel rank: its local value."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss
        self.tokens: Tensor = torch.ones(())

    def __call__(self, output: Tensor, labels: Tensor) -> Tensor:
        return local_tensor(self.loss(output, labels, reduction="sum")) / self.tokens


class _StepGradients:
    """The gradients one training step of the schedule computed, held apart from ``.grad`` until the backward of the
    loss it returned: that backward adds them, times the factor it brings (``1 / accumulate_grad_batches``, a loss
    scale), as autograd would have. Code between the forward and the backward (Lightning's ``zero_grad`` on the
    first batch of an accumulation window) then sees the gradients of earlier steps only."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.grads = [(param, param.grad) for param in params if param.grad is not None]

    def release(self, factor: Tensor) -> None:
        for param, grad in self.grads:
            local_tensor(grad).mul_(factor.to(grad.dtype))
            if param.grad is None:
                param.grad = grad
            else:
                local_tensor(param.grad).add_(local_tensor(grad))
        self.grads = []


class _PipelineLoss(torch.autograd.Function):
    """The step's loss as autograd sees it: its value, whose backward releases the step's gradients."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, loss: Tensor, gradients: _StepGradients) -> Tensor:
        ctx.gradients = gradients
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, factor: Tensor) -> tuple[None, None, None]:
        ctx.gradients.release(factor)
        return None, None, None


class Pipeline:
    """This rank's share of a pipeline: its stages (``torch.distributed.pipelining.PipelineStage``), the schedule, the
    loss; :meth:`run` returns the batch's loss on every rank of ``pp_group``. ``split_.module``: the pruned model,
    whose ``loss(output, labels, reduction)`` the last stage calls. ``sequence_group``: the context-parallel ranks, each holding a part of every sequence (None: none); the loss
    is then this rank's share of the mean over the group's labelled tokens, as ``ContextParallel.token_mean`` gives
    it without a pipeline."""

    def __init__(self, split_: PipelineSplit, schedule: str, microbatches: int, pp_group: Any, device: torch.device,
                 per_rank: int, sequence_group: Any = None) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.split = split_
        self.sequence_group = sequence_group
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.pp_group = pp_group
        self.device = device
        self.loss = _TokenMeanLoss(split_.module.loss)
        self.stages = [PipelineStage(view, index, split_.num_stages, device, group=pp_group)
                       for index, view in sorted(split_.stages.items())]
        for stage in self.stages:
            compat.run_shape_inference_inside(stage, _inferring)
        self.has_last = any(stage.is_last for stage in self.stages)
        pp = dist.get_world_size(pp_group)
        self.last_stage_rank = facts.last_stage_rank(schedule, pp, per_rank)
        self.schedule = self._build()
        self._shapes: Optional[tuple] = None

    def _build(self, with_loss: bool = True) -> Any:
        from torch.distributed.pipelining import schedules

        cls = getattr(schedules, facts.SCHEDULES[self.schedule_name].class_name, None)
        if cls is None:
            raise RuntimeError(f"pipeline_schedule={self.schedule_name!r} needs torch >="
                               f" {facts.SCHEDULES[self.schedule_name].since}; this is torch {torch.__version__}")
        stages = self.stages if issubclass(cls, schedules.PipelineScheduleMulti) else self.stages[0]
        self._with_loss = with_loss
        return cls(stages, self.microbatches, loss_fn=self.loss if with_loss else None, scale_grads=False)

    def install(self) -> None:
        """Make the pruned model's ``forward(x, *, labels=None, **kwargs)`` run the pipeline: with labels the loss
        (``run``), without them and without autograd (``predict_step``, evaluation) the outputs (``outputs``)."""
        def forward(x: Tensor, *, labels: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
            if labels is not None:
                return self.run(x, labels, **kwargs)
            if torch.is_grad_enabled():
                raise ValueError(
                    "under pipeline parallelism a training call takes the labels and returns the loss (each stage"
                    " holds part of the model, and only the last sees the outputs): call model(inputs, labels=labels);"
                    " the outputs themselves come from a call without labels under torch.no_grad() (predict_step)"
                )
            return self.outputs(x, **kwargs)

        self.split.module.forward = forward

    def run(self, x: Tensor, labels: Tensor, **kwargs: Any) -> Tensor:
        """The batch's mean loss over its labelled tokens, on every rank of the pipeline. With autograd on, every
        microbatch's forward and backward run here, and the backward of the returned loss puts the gradients in
        ``.grad`` (:class:`_StepGradients`); otherwise the forward only. ``kwargs`` that are None are left out."""
        x, labels, kwargs = self._check_shapes(x, labels, self._keyword_inputs(x, kwargs))
        self.loss.tokens = self._labelled_tokens(labels)
        losses: list[Tensor] = []
        if not torch.is_grad_enabled():
            try:
                with _no_local_backward_handoff(self.stages):
                    self.schedule.eval(x, target=labels, losses=losses, **kwargs)
            finally:
                for view in self.split.stages.values():  # parameters kept gathered for a backward that never comes
                    reshard(view)
            return self._broadcast(torch.stack(losses).sum() if self.has_last else None)
        params = [param for param in self.split.module.parameters() if param.requires_grad]
        earlier = [param.grad for param in params]
        for param in params:
            param.grad = None
        try:
            self.schedule.step(x, target=labels, losses=losses, return_outputs=False, **kwargs)
            gradients = _StepGradients(params)
        finally:
            for param, grad in zip(params, earlier):
                param.grad = grad
        loss = self._broadcast(torch.stack(losses).sum() if self.has_last else None)
        anchor = torch.ones((), device=loss.device, requires_grad=True)
        return _PipelineLoss.apply(anchor, loss, gradients)

    def outputs(self, x: Tensor, **kwargs: Any) -> Tensor:
        """The model's outputs for the batch ``x`` (forward only, no loss: what ``predict_step`` wants), on every
        rank of the pipeline: the last stage computes them and broadcasts them over ``pp_group``, so each rank's
        ``predict_step`` returns what it returns without pipeline parallelism (the cost: one copy of the outputs,
        batch x sequence x vocabulary for a decoder, sent to each other stage per batch). A batch that does not
        split into the microbatches is padded with copies of its last row, which are cut off again."""
        if torch.is_grad_enabled():
            raise RuntimeError("Pipeline.outputs runs the forward-only schedule: call it under torch.no_grad()")
        rows = x.shape[0]
        x, _, kwargs = self._check_shapes(x, None, self._keyword_inputs(x, kwargs))
        try:
            with _no_local_backward_handoff(self.stages):
                output = self.schedule.eval(x, **kwargs)
        finally:
            for view in self.split.stages.values():  # parameters kept gathered for a backward that never comes
                reshard(view)
        if self.has_last:
            # Vocabulary-split logits (loss_parallel) are gathered whole, as a caller without the pipeline sees them.
            output = (output.full_tensor() if hasattr(output, "full_tensor") else output)[:rows].contiguous()
        meta = [(tuple(output.shape), output.dtype) if self.has_last else None]
        source = dist.get_global_rank(self.pp_group, self.last_stage_rank)
        dist.broadcast_object_list(meta, src=source, group=self.pp_group, device=self.device)
        if not self.has_last:
            shape, dtype = meta[0]
            output = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(output, src=source, group=self.pp_group)
        return output

    def _keyword_inputs(self, x: Tensor, kwargs: dict[str, Any]) -> dict[str, Any]:
        """What every stage gets beside its input: ``kwargs`` but those that are None, and the rows' positions
        (``0 .. seq - 1`` of ``x`` [rows, seq, ...]) where the layout names them and the caller gives none."""
        kwargs = {name: value for name, value in kwargs.items() if value is not None}
        name = self.split.positions
        if name is not None and name not in kwargs:
            kwargs[name] = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return kwargs

    def _check_shapes(self, x: Tensor, labels: Optional[Tensor], kwargs: dict[str, Any]
                      ) -> tuple[Tensor, Optional[Tensor], dict]:
        """The step's inputs, split-ready: every keyword input a tensor of the batch's rows; under evaluation a batch
        that does not split into equal microbatches (the last, short one) padded with rows of no label, which
        change no loss. A new shape, or a switch between the loss (``labels``) and the outputs (no labels: a schedule
        without a loss), builds the schedule again."""
        rows = x.shape[0]
        bad = [name for name, value in kwargs.items() if not (isinstance(value, Tensor) and value.shape[:1] == (rows,))]
        if bad:
            raise ValueError(
                f"under pipeline parallelism every keyword input is split by rows into the microbatches, but {bad}"
                f" are not tensors of {rows} rows (packed samples' boundaries, cu_seqlens, cannot be split: train"
                " without packing)"
            )
        if rows % self.microbatches:
            if torch.is_grad_enabled():
                raise ValueError(
                    f"a batch of {rows} rows does not split into pipeline_microbatches={self.microbatches} equal"
                    " microbatches: make the batch size a multiple of it (and the last batch whole: drop_last=True)"
                )
            if labels is not None and (labels.is_floating_point() or labels.is_complex()):
                raise ValueError(
                    f"an evaluation batch of {rows} rows does not split into pipeline_microbatches={self.microbatches}"
                    f" equal microbatches, and its labels are {labels.dtype}: the pipeline pads such a batch with rows"
                    f" of label {IGNORE_INDEX}, which marks no loss only among integer labels (a regression target of"
                    f" {IGNORE_INDEX} would count); give the evaluation loader a batch size and a dataset size that"
                    " divide by it, or drop_last=True"
                )
            missing = self.microbatches - rows % self.microbatches
            x, *values = (torch.cat([t, t[-1:].expand(missing, *t.shape[1:])]) for t in (x, *kwargs.values()))
            kwargs = dict(zip(kwargs, values))
            if labels is not None:
                labels = torch.cat([labels, labels.new_full((missing, *labels.shape[1:]), IGNORE_INDEX)])
        shapes = tuple((tuple(t.shape), t.dtype) if t is not None else None for t in (x, labels, *kwargs.values()))
        # torch infers the P2P buffers at a schedule's first step: a new schedule over the same stages infers the
        # new shapes (a shorter batch, another sequence length), where the old would fail in a receive. Without
        # labels the last stage computes no loss (torch's would index the missing targets).
        if (self._shapes is not None and shapes != self._shapes) or (labels is not None) != self._with_loss:
            self.schedule = self._build(with_loss=labels is not None)
        self._shapes = shapes
        return x, labels, kwargs

    def _labelled_tokens(self, labels: Tensor) -> Tensor:
        """What each microbatch's summed loss is divided by: the batch's labelled tokens, or under context
        parallelism the group's over its size (each rank's loss its share: their mean is the mean over them all)."""
        tokens = (labels != IGNORE_INDEX).sum().to(torch.float32)
        if self.sequence_group is None:
            return tokens.clamp_min(1)
        dist.all_reduce(tokens, group=self.sequence_group)
        return tokens.clamp_min(1) / dist.get_world_size(self.sequence_group)

    def _broadcast(self, value: Optional[Tensor]) -> Tensor:
        loss = torch.zeros((), device=self.device) if value is None else value.detach().to(self.device).reshape(())
        loss = loss.to(torch.float32)
        dist.broadcast(loss, src=dist.get_global_rank(self.pp_group, self.last_stage_rank), group=self.pp_group)
        return loss


@contextmanager
def _no_local_backward_handoff(stages: Sequence[Any]) -> Iterator[None]:
    """torch 2.13's ``eval()`` on a V-shaped schedule (ZBV, DualPipeV) still hands input gradients to the adjacent
    stage on the same rank, which raises without a backward ("can't steal_bwd_input if this stage doesn't have
    backward"); inside this the hand-off does nothing."""
    for stage in stages:
        stage.get_local_bwd_output = lambda mb_index: ()
        stage.set_local_bwd_input = lambda outputs, mb_index: None
    try:
        yield
    finally:
        for stage in stages:
            del stage.get_local_bwd_output, stage.set_local_bwd_input


__all__ = ["IGNORE_INDEX", "KeptBlocks", "check_split", "inferring_shapes", "Pipeline", "PipelineSplit", "split"]
