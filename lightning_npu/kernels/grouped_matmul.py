"""Grouped matmul over experts: torch_npu.npu_grouped_matmul inside a custom autograd Function on NPU tensors, an
exact PyTorch reference elsewhere.

x holds the tokens sorted by expert ([T, K], expert 0's rows first), weight the stacked experts [E, K, N], counts
the tokens of each expert [E]; row block e of x is multiplied by weight[e]. torch_npu registers no backward for
npu_grouped_matmul in any release: a direct call returns an output without a grad_fn, so the experts would never
train and nothing would say so. The fused path is therefore ``_NpuGroupedMatmul``, whose backward makes the dX and
dW calls itself (the three calls of torchtitan-npu and MindSpeed, moe-facts.md section 2).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_npu.kernels._dispatch import (
    FUSED_DTYPES,
    chip_unsupported_reason,
    note_fallback,
    release_unsupported_reason,
    unavailable_reason,
)

# npu_grouped_matmul's documented limits with one stacked 3-D weight: at most 1024 groups, inner dims < 65536.
_FUSED_MAX_EXPERTS = 1024
_FUSED_MAX_INNER = 65535
# The dW call splits x's K axis (group_type=2), which torch_npu 2.6.0's library rejects.
_FUSED_MIN_RELEASE = (2, 13)
# npu_grouped_matmul's group_list modes: 1 = counts, 0 = cumulative ends. Count mode rejects a list of length 1;
# for one expert the count is also its cumulative end, so the same tensor goes in with type 0.
_COUNTS, _CUMULATIVE_ENDS = 1, 0
# group_type 0 splits x's M axis (the forward and dX calls), 2 splits its K axis (the dW call: x is X^T);
# split_item 2 / 3 return one output tensor rather than one per group.
_SPLIT_M, _SPLIT_K = 0, 2
_ONE_OUTPUT, _ONE_STACKED_OUTPUT = 2, 3
# torch._grouped_mm on CPU (torch 2.9 .. 2.13) takes fp16/bf16/fp32 with 16-byte aligned strides and data.
_GROUPED_MM_ALIGNMENT = 16


def grouped_matmul(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """Rows of expert e (the e-th block of ``counts[e]`` rows of ``x``) times ``weight[e]``: [T, N] in x's dtype.

    ``counts`` (integer, [E]) must sum to T; an expert with no rows gets a zero weight gradient. The weight is cast
    to x's dtype first, as autocast casts an fp32 master weight for a matmul (its gradient returns in the weight's
    own dtype). The reference path reads ``counts`` on the host (and checks them); the fused path does not, so it
    adds no host sync.
    """
    _check_inputs(x, weight, counts)
    weight = weight.to(x.dtype)
    reason = why_not_fused(x, weight, counts)
    if reason is None:
        # x of a group_type=0 call may not be a view (the weight may); .contiguous() is free when it already is.
        return _NpuGroupedMatmul.apply(x.contiguous(), weight, counts.to(device=x.device, dtype=torch.int64))
    note_fallback("grouped_matmul", x, reason)
    return reference_grouped_matmul(x, weight, counts)


def why_not_fused(x: Tensor, weight: Tensor, counts: Tensor) -> Optional[str]:
    """Why :func:`grouped_matmul` would run the reference path on these inputs; None when it runs the fused op."""
    return unavailable_reason("grouped_matmul", x, lambda: _fused_limits(x, weight))


def _check_inputs(x: Tensor, weight: Tensor, counts: Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"grouped_matmul takes x [tokens, K] and stacked weights [experts, K, N] with the same K; got x"
            f" {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    integer = not counts.dtype.is_floating_point and counts.dtype != torch.bool
    if counts.dim() != 1 or counts.numel() != weight.shape[0] or not integer:
        raise ValueError(
            f"counts must be an integer tensor with one entry per expert ({weight.shape[0]}); got {counts.dtype}"
            f" {tuple(counts.shape)}. Count the tokens with torch.bincount(expert_ids.flatten(), minlength=experts)"
        )


def _fused_limits(x: Tensor, weight: Tensor) -> Optional[str]:
    experts, k, n = weight.shape
    if experts > _FUSED_MAX_EXPERTS:
        return f"{experts} experts exceed npu_grouped_matmul's limit of {_FUSED_MAX_EXPERTS} groups"
    if max(k, n) > _FUSED_MAX_INNER:
        return f"K={k} or N={n} exceeds npu_grouped_matmul's limit (< 65536)"
    why = "older releases reject the weight gradient's group_type=2"
    return release_unsupported_reason("npu_grouped_matmul", _FUSED_MIN_RELEASE, why) or chip_unsupported_reason(
        "npu_grouped_matmul")


class _NpuGroupedMatmul(torch.autograd.Function):
    """npu_grouped_matmul forward, with the dX (transposed weights) and dW (group_type=2) calls as its backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight, counts)
        return _npu_grouped_matmul(x, weight, counts, _SPLIT_M, _ONE_OUTPUT)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], None]:
        x, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()  # the dX call's x
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _npu_grouped_matmul(grad, weight.transpose(1, 2), counts, _SPLIT_M, _ONE_OUTPUT)
        if ctx.needs_input_grad[1]:
            # X_e^T dY_e per expert, stacked to [E, K, N]; an expert with no rows gets zeros.
            dw = _npu_grouped_matmul(x.t(), grad, counts, _SPLIT_K, _ONE_STACKED_OUTPUT)
        return dx, dw, None


def _npu_grouped_matmul(a: Tensor, b: Tensor, counts: Tensor, group_type: int, split_item: int) -> Tensor:
    import torch_npu

    group_list_type = _COUNTS if counts.numel() > 1 else _CUMULATIVE_ENDS
    return torch_npu.npu_grouped_matmul(
        [a], [b], group_list=counts, split_item=split_item, group_type=group_type, group_list_type=group_list_type
    )[0]


def reference_grouped_matmul(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """:func:`grouped_matmul` on its PyTorch path whatever the device: what the fused op must match.

    ``torch._grouped_mm`` where this torch has it for these inputs (CPU, fp16/bf16/fp32, 16-byte aligned), else one
    matmul per expert. Both are differentiable by autograd, and both give an expert with no rows a zero gradient.
    """
    _check_inputs(x, weight, counts)
    weight = weight.to(x.dtype)
    sizes = counts.tolist()
    if min(sizes, default=0) < 0 or sum(sizes) != x.shape[0]:
        raise ValueError(
            f"counts {sizes} must be >= 0 and sum to the {x.shape[0]} rows of x (the tokens sorted by expert)"
        )
    if _grouped_mm_takes(x, weight):
        # torch._grouped_mm takes int32 cumulative ends ("Offsets have to be int32").
        ends = counts.cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight, offs=ends))
    return torch.cat([rows @ w for rows, w in zip(x.split(sizes), weight.unbind(0))])


def _grouped_mm_takes(x: Tensor, weight: Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cpu" or x.dtype not in FUSED_DTYPES:
        return False
    if x.shape[0] == 0:
        return False  # its backward rejects the [0, N] gradient of a batch without tokens (a rank under EP)
    size = x.element_size()
    return all(
        t.data_ptr() % _GROUPED_MM_ALIGNMENT == 0
        and all(stride == 1 or stride * size % _GROUPED_MM_ALIGNMENT == 0 for stride in t.stride())
        for t in (x, weight)
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch._grouped_mm's backward rejects the expanded
    gradient of ``out.sum()`` ("Invalid strides/sizes, got [0, 0]", torch 2.13 CPU)."""

    @staticmethod
    def forward(ctx, out: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()
