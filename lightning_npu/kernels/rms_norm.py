"""RMSNorm: torch_npu.npu_rms_norm on NPU tensors, an fp32 PyTorch reference elsewhere."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_npu.kernels._dispatch import FUSED_DTYPES, note_fallback, unavailable_reason

# npu_rms_norm's documented input ranks.
_FUSED_MIN_DIMS, _FUSED_MAX_DIMS = 2, 8


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dimension, returned in x's dtype.

    ``weight`` has shape [x.shape[-1]]. The statistics are computed in fp32 whatever x's dtype, as in
    LLaMA, so bf16 activations do not lose the mean of squares to rounding.

    npu_rms_norm requires gamma's dtype to equal x's, so on the fused path the weight is cast to x's dtype
    first, as autocast casts an fp32 master weight for a matmul: the gradient still reaches the weight in
    its own dtype (the cast's backward upcasts it), and differs from the fp32 reference's by one rounding
    to x's dtype, the precision every other bf16 layer's weight gradient has.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} must be ({x.shape[-1]},), the size of x's last dimension "
            f"(x shape {tuple(x.shape)})."
        )
    reason = why_not_fused(x, weight)
    if reason is None:
        import torch_npu

        return torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
    note_fallback("rms_norm", x, reason)
    return reference_rms_norm(x, weight, eps)


def why_not_fused(x: Tensor, weight: Tensor) -> Optional[str]:
    """Why :func:`rms_norm` would run the reference path on these inputs; None when it runs the fused op."""
    return unavailable_reason("rms_norm", x, lambda: _fused_limits(x, weight))


def _fused_limits(x: Tensor, weight: Tensor) -> Optional[str]:
    if weight.dtype not in FUSED_DTYPES:
        return f"(x, weight) dtypes ({x.dtype}, {weight.dtype}) are not fp16/bf16/fp32"
    if not _FUSED_MIN_DIMS <= x.dim() <= _FUSED_MAX_DIMS:
        return f"x has {x.dim()} dimensions; npu_rms_norm takes {_FUSED_MIN_DIMS} to {_FUSED_MAX_DIMS}"
    return None


def reference_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """:func:`rms_norm` on its PyTorch path whatever the device: what the fused op must match."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
