"""RMSNorm: torch_npu.npu_rms_norm on NPU tensors, an fp32 PyTorch reference elsewhere."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_npu.kernels._fallback import log_fallback_once

# (x dtype, weight dtype) pairs npu_rms_norm accepts on Atlas A2.
_FUSED_DTYPE_PAIRS = {
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
    (torch.float32, torch.float32),
}


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dimension, returned in x's dtype.

    ``weight`` has shape [x.shape[-1]]. The statistics are computed in fp32 whatever x's dtype, as in
    LLaMA, so bf16 activations do not lose the mean of squares to rounding.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} must be ({x.shape[-1]},), the size of x's last dimension "
            f"(x shape {tuple(x.shape)})."
        )
    if _on_npu(x):
        reason = _fused_unsupported_reason(x, weight)
        if reason is None:
            import torch_npu

            return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
        log_fallback_once("rms_norm", reason)
    return _reference_rms_norm(x, weight, eps)


def _on_npu(x: Tensor) -> bool:
    return x.device.type == "npu"


def _fused_unsupported_reason(x: Tensor, weight: Tensor) -> Optional[str]:
    if (x.dtype, weight.dtype) not in _FUSED_DTYPE_PAIRS:
        return f"(x, weight) dtypes ({x.dtype}, {weight.dtype}) are not a pair npu_rms_norm supports"
    return None


def _reference_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
