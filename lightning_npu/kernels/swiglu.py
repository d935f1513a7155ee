"""SwiGLU gate: torch_npu.npu_swiglu on NPU tensors, silu(a) * b elsewhere."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_npu.kernels._dispatch import chip_unsupported_reason, note_fallback, unavailable_reason


def swiglu(x: Tensor) -> Tensor:
    """Split the last dimension into halves (a, b) and return ``silu(a) * b`` (half the last dimension).

    Feed it the concatenated gate and up projections ``cat([x @ W_gate, x @ W_up], -1)``.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(
            f"swiglu splits the last dimension into two equal halves, but it has odd size {x.shape[-1]} "
            f"(x shape {tuple(x.shape)}); concatenate the gate and up projections, which have equal widths."
        )
    reason = why_not_fused(x)
    if reason is None:
        import torch_npu

        # npu_swiglu documents contiguous input only; .contiguous() is free when it already is.
        return torch_npu.npu_swiglu(x.contiguous(), dim=-1)
    note_fallback("swiglu", x, reason)
    return reference_swiglu(x)


def why_not_fused(x: Tensor) -> Optional[str]:
    """Why :func:`swiglu` would run the reference path on this input; None when it runs the fused op."""
    return unavailable_reason("swiglu", x, lambda: chip_unsupported_reason("npu_swiglu"))


def reference_swiglu(x: Tensor) -> Tensor:
    """:func:`swiglu` on its PyTorch path whatever the device: what the fused op must match."""
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b
