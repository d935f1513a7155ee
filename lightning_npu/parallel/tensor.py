"""Tensor parallelism (with sequence parallelism and loss parallelism): a model's plan applied over the ``tp`` ranks.

The plan is the model's (``ParallelPlan.tensor_parallel``): torch's ``parallelize_module`` styles by module name,
built for the strategy's ``sequence_parallel`` and ``loss_parallel`` options. Each rank keeps its local split of its
own values (no scatter): rank 0's whole values reach every rank after sharding (``strategies.initial_state``), so
ranks that built on the meta device need no peer here. A plan never splits the experts (``ParallelPlan.experts``):
under tensor parallelism each tensor-parallel rank runs a share of their rows instead (``parallel.expert``).

Besides torch's styles a plan may use :class:`ReplicatedParallel`: a small module computed whole on every rank (a
low-rank projection, a norm), with the gradient of the output channels each rank reads only in part summed.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_npu.parallel.mesh import TENSOR_PARALLEL_DIMS
from lightning_npu.parallel.protocol import TensorParallelPlan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan, *,
                          sequence_parallel: bool, loss_parallel: bool,
                          experts: Sequence[tuple[str, nn.Module]] = ()) -> list[str]:
    """Split the modules ``plan`` names over the ranks of ``tp_mesh``; returns their names. TypeError if the plan
    is not a dict of styles; ValueError if it names one of the ``experts`` modules or a module inside one."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    styles = plan(tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if not isinstance(styles, dict) or not all(isinstance(style, ParallelStyle) for style in styles.values()):
        raise TypeError(
            f"the tensor-parallel plan returned {type(styles).__name__}; it must return a dict of module names to"
            " torch.distributed.tensor.parallel styles (ColwiseParallel(), RowwiseParallel(), ...)"
        )
    inside_experts = [name for name in styles for expert_name, _ in experts
                      if name == expert_name or name.startswith(expert_name + ".")]
    if inside_experts:
        raise ValueError(
            f"the tensor-parallel plan splits {inside_experts}, which are experts (ParallelPlan.experts): experts are"
            " not split by tensor parallelism here; each tensor-parallel rank runs a share of their rows, and"
            " expert_parallel_size splits them over ranks (the tensor-parallel ones included). Remove those entries"
            " from the plan"
        )
    tied = _tied_parameters(model)
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    _tie_again(tied)
    return sorted(styles)


def _tied_parameters(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """Each parameter registered under several names (a tied embedding and head), as ``(name, module, attribute)``
    of every place it is registered."""
    places: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((f"{module_name}.{attribute}".lstrip("."), module, attribute))
    return [group for group in places.values() if len(group) > 1]


def _tie_again(tied: list[list[tuple[str, nn.Module, str]]]) -> None:
    """Make each tied parameter one parameter again after the plan split its places one by one (each style made a
    parameter of its own); ValueError if the plan split them differently, since one tensor cannot hold both. (A tied
    embedding and head both split by vocabulary rows, ``Shard(0)``, as the row-parallel embedding and the
    column-parallel head do.)"""
    for group in tied:
        first_name, first_module, first_attribute = group[0]
        param = getattr(first_module, first_attribute)
        for name, module, attribute in group[1:]:
            other = getattr(module, attribute)
            if other is param:
                continue
            layouts = [(getattr(p, "device_mesh", None), tuple(getattr(p, "placements", ()))) for p in (param, other)]
            if layouts[0] != layouts[1]:
                raise ValueError(
                    f"{first_name} and {name} are one tied parameter, but the tensor-parallel plan splits them"
                    f" differently ({layouts[0][1]} and {layouts[1][1]}); split both alike (a tied embedding and head:"
                    " RowwiseParallel on the embedding and ColwiseParallel on the head both split the vocabulary"
                    " rows) or untie them"
                )
            setattr(module, attribute, param)


def tensor_parallel_parameters(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters split over tensor-parallel ranks (by a plan or by the user's code)."""
    from torch.distributed.tensor import DTensor

    return [name for name, param in model.named_parameters()
            if isinstance(param, DTensor) and TENSOR_PARALLEL_DIMS & set(param.device_mesh.mesh_dim_names or ())]


@contextmanager
def loss_parallel_if(enabled: bool) -> Iterator[None]:
    """torch's ``loss_parallel()`` (cross-entropy on vocabulary-split logits, its backward too) when ``enabled``."""
    if not enabled:
        with nullcontext():
            yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


class ReplicatedParallel(ParallelStyle):
    """Run a module whole on every tensor-parallel rank, on its replicated input, its parameters left plain.

    A small module whose input every rank holds whole (a low-rank projection after the sequence-parallel gather, a
    norm after it) is cheaper to compute redundantly than to split: its parameters stay ordinary tensors (data
    parallelism shards them as any other) and their gradients come out equal on every rank as long as the gradient
    of the module's output does. That holds for output channels read by a column-parallel layer (whose backward
    all-reduces its input's gradient) or by more replicated computation, but not for channels each rank reads only
    in part, such as a key shared by all heads and read by each rank's own heads: their gradient on a rank is that
    rank's share. ``partial_grad_channels`` names those channels (a slice of the output's last dimension); their
    gradient is summed over the ranks in backward, the forward is untouched. A DTensor input is redistributed to
    ``Replicate`` and made local; a plain tensor input is taken as already replicated.
    """

    def __init__(self, *, partial_grad_channels: Optional[slice] = None) -> None:
        super().__init__()
        if partial_grad_channels is not None and (not isinstance(partial_grad_channels, slice)
                                                  or partial_grad_channels.step not in (None, 1)):
            raise ValueError(f"partial_grad_channels={partial_grad_channels!r} must be a contiguous slice of the"
                             " output's last dimension, e.g. slice(512, 576)")
        self.partial_grad_channels = partial_grad_channels

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"ReplicatedParallel takes the 1-D tensor-parallel mesh, not a {device_mesh.ndim}-D one")
        module.register_forward_pre_hook(_replicated_local_inputs)
        if self.partial_grad_channels is not None:
            module.register_forward_hook(partial(_sum_grad_channels, self.partial_grad_channels,
                                                 device_mesh.get_group()))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(partial_grad_channels={self.partial_grad_channels})"


def _replicated_local_inputs(_module: nn.Module, inputs: tuple) -> tuple:
    # to_local's backward takes the local gradient as Replicate: right, as every rank's comes out whole.
    return tuple(x.redistribute(placements=[Replicate()]).to_local() if isinstance(x, DTensor) else x for x in inputs)


def _sum_grad_channels(channels: slice, group: dist.ProcessGroup, _module: nn.Module, _inputs: tuple,
                       output: Tensor) -> Tensor:
    return _SumGradChannels.apply(output, channels, group)


class _SumGradChannels(torch.autograd.Function):
    """Identity forward; backward sums the gradient of the ``channels`` of the last dimension over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, channels: slice, group: dist.ProcessGroup) -> Tensor:
        ctx.channels, ctx.group = channels, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None]:
        start, stop, _ = ctx.channels.indices(grad.shape[-1])
        summed = grad[..., start:stop].contiguous()
        dist.all_reduce(summed, group=ctx.group)
        return torch.cat((grad[..., :start], summed, grad[..., stop:]), dim=-1), None, None


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor`` if it is a DTensor (a shard; a loss computed on vocabulary-split logits, alike
    on every tensor-parallel rank), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


__all__ = ["ReplicatedParallel", "apply_tensor_parallel", "local_tensor", "loss_parallel_if",
           "tensor_parallel_parameters"]
