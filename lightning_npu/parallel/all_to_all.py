"""The one differentiable all-to-all: context parallelism's Ulysses exchange and expert parallelism's token exchange.

``all_to_all(x, group, send, receive)`` sends ``send[r]`` rows of ``x`` (dim 0, in rank order) to rank ``r`` of
``group`` and returns the ``receive[r]`` rows each rank ``r`` sent it, concatenated in rank order; without sizes, dim 0
splits into equal parts. Its backward is the reverse exchange of the gradients (``all_to_all_single`` over HCCL on
NPUs, gloo when simulated).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def all_to_all(x: Tensor, group: Any, send: Optional[Sequence[int]] = None,
               receive: Optional[Sequence[int]] = None) -> Tensor:
    """See the module docstring. ``send`` and ``receive`` are host ints (both, or neither)."""
    if (send is None) != (receive is None):
        raise ValueError("all_to_all takes both send and receive sizes, or neither (equal parts)")
    return _AllToAll.apply(x, group, None if send is None else list(send), None if receive is None else list(receive))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, send: Optional[list[int]], receive: Optional[list[int]]) -> Tensor:
        ctx.group, ctx.sizes = group, (send, receive)
        return _exchange(x, group, send, receive)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        send, receive = ctx.sizes
        return _exchange(grad, ctx.group, receive, send), None, None, None


def _exchange(x: Tensor, group: Any, send: Optional[list[int]], receive: Optional[list[int]]) -> Tensor:
    x = x.contiguous()
    if send is None:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


__all__ = ["all_to_all"]
