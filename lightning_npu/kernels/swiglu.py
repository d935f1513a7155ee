"""SwiGLU gate: torch_npu.npu_swiglu on NPU tensors, silu(a) * b elsewhere."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_npu.kernels._fallback import chip_unsupported_reason, log_fallback_once

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def swiglu(x: Tensor) -> Tensor:
    """Split the last dimension into halves (a, b) and return ``silu(a) * b`` (half the last dimension).

    Feed it the concatenated gate and up projections ``cat([x @ W_gate, x @ W_up], -1)``.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(
            f"swiglu splits the last dimension into two equal halves, but it has odd size {x.shape[-1]} "
            f"(x shape {tuple(x.shape)}); concatenate the gate and up projections, which have equal widths."
        )
    if _on_npu(x):
        reason = _fused_unsupported_reason(x)
        if reason is None:
            import torch_npu

            # npu_swiglu documents contiguous input only; .contiguous() is free when it already is.
            return torch_npu.npu_swiglu(x.contiguous(), dim=-1)
        log_fallback_once("swiglu", reason)
    return _reference_swiglu(x)


def _on_npu(x: Tensor) -> bool:
    return x.device.type == "npu"


def _fused_unsupported_reason(x: Tensor) -> Optional[str]:
    if x.dtype not in _FUSED_DTYPES:
        return f"dtype {x.dtype} is not one of fp16/bf16/fp32"
    return chip_unsupported_reason("npu_swiglu")


def _reference_swiglu(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b
