"""Fused kernels for LLaMA-style and MoE models, and matmuls with a frozen quantized weight: torch_npu kernels on NPU
tensors, exact PyTorch paths elsewhere.

Every function takes BSND tensors ([batch, seq, heads, head_dim]) where it takes attention heads, picks
its path from the input tensor's device (see ``_dispatch``), and logs once whenever an NPU input has to use the
reference path. ``reference_*`` run the PyTorch path on any device, and ``why_not_fused(op, *inputs)`` says which
path a kernel would take (``lightning-npu selftest`` compares the two on the user's NPUs).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_npu.kernels import attention as _attention
from lightning_npu.kernels import grouped_matmul as _grouped_matmul
from lightning_npu.kernels import quantized_matmul as _quantized_matmul
from lightning_npu.kernels import rms_norm as _rms_norm
from lightning_npu.kernels import rotary as _rotary
from lightning_npu.kernels import swiglu as _swiglu
from lightning_npu.kernels import token_permute as _token_permute
from lightning_npu.kernels._dispatch import DISABLE_FUSED_ENV, FUSED_OPS, FusedOp, disabled_ops
from lightning_npu.kernels.attention import causal_attention, reference_attention
from lightning_npu.kernels.grouped_matmul import grouped_matmul, reference_grouped_matmul
from lightning_npu.kernels.packed_attention import packed_causal_attention, reference_packed_attention
from lightning_npu.kernels.quantized_matmul import quantized_linear, reference_quantized_linear
from lightning_npu.kernels.rms_norm import reference_rms_norm, rms_norm
from lightning_npu.kernels.rotary import apply_rotary, reference_rotary, rotary_tables
from lightning_npu.kernels.swiglu import reference_swiglu, swiglu
from lightning_npu.kernels.token_permute import (
    TokenPermutation,
    permute_tokens,
    reference_permute_tokens,
    reference_unpermute_tokens,
    unpermute_tokens,
)

_WHY_NOT_FUSED = {
    "attention": _attention.why_not_fused,
    "grouped_matmul": _grouped_matmul.why_not_fused,
    "rms_norm": _rms_norm.why_not_fused,
    "rotary": _rotary.why_not_fused,
    "swiglu": _swiglu.why_not_fused,
    "token_permute": _token_permute.why_not_fused,
    "weight_quant_matmul": _quantized_matmul.why_not_fused,
}


def why_not_fused(op: str, *inputs: Any) -> Optional[str]:
    """Why kernel ``op`` (a ``FUSED_OPS`` name) would take its reference path on ``inputs`` (the kernel function's
    tensor arguments); None when it would run its torch_npu fused op."""
    return _WHY_NOT_FUSED[op](*inputs)


__all__ = [
    "DISABLE_FUSED_ENV",
    "FUSED_OPS",
    "FusedOp",
    "TokenPermutation",
    "apply_rotary",
    "causal_attention",
    "disabled_ops",
    "grouped_matmul",
    "packed_causal_attention",
    "permute_tokens",
    "quantized_linear",
    "reference_attention",
    "reference_grouped_matmul",
    "reference_packed_attention",
    "reference_permute_tokens",
    "reference_quantized_linear",
    "reference_rms_norm",
    "reference_rotary",
    "reference_swiglu",
    "reference_unpermute_tokens",
    "rms_norm",
    "rotary_tables",
    "swiglu",
    "unpermute_tokens",
    "why_not_fused",
]
