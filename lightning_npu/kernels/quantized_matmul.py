"""A matmul with a frozen quantized weight (``lightning_npu.quant``): torch_npu.npu_weight_quant_batchmatmul for the
forward of int8 weights on NPU tensors, decode-then-matmul elsewhere, inside one custom autograd Function.

The weight is frozen, so its codes and scales get no gradient, and the input's gradient is ``grad @ W`` with ``W``
the decoded weight: decoded again in backward rather than saved, so no full-precision copy of the weight outlives
its matmul (autograd would keep one for ``F.linear(x, dequantize(...))``). torch_npu registers no backward for
npu_weight_quant_batchmatmul (low-precision-facts.md section 2), so only its forward is called, and only inside the
Function; its documented limits (A2/A3, fp16/bf16 input, K and N <= 65535, a per-channel scale in x's dtype) decide
whether it runs. NF4 has no torch_npu op (npu_weight_quant_batchmatmul takes int8 or packed int4 codes): it always
decodes, and an NPU run says so once, as every reference path does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.nn import functional as F

from lightning_npu.kernels._dispatch import (
    chip_unsupported_reason,
    note_fallback,
    release_unsupported_reason,
    unavailable_reason,
)
from lightning_npu.quant.weights import dequantize

# npu_weight_quant_batchmatmul's documented limits: x fp16/bf16 on A2/A3, K and N in [1, 65535].
_FUSED_DTYPES = (torch.float16, torch.bfloat16)
_FUSED_MAX_INNER = 65535
_FUSED_MIN_RELEASE = (2, 13)


def quantized_linear(x: Tensor, codes: Tensor, scales: Tensor, scheme: str, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ W.T (+ bias)`` in x's dtype, ``W`` [out, in] the weight that ``codes`` and ``scales`` store in
    ``scheme`` (``lightning_npu.facts.weight_quant``). Only ``x`` (and a bias that requires it) gets a gradient."""
    reason = why_not_fused(x, codes, scales, scheme)
    if reason is not None:
        note_fallback("weight_quant_matmul", x, reason)
    out = _QuantizedMatmul.apply(x, codes, scales, scheme, reason is None)
    return out if bias is None else out + bias.to(out.dtype)


def why_not_fused(x: Tensor, codes: Tensor, scales: Tensor, scheme: str) -> Optional[str]:
    """Why :func:`quantized_linear` would decode and matmul on these inputs; None when it runs the fused op."""
    return unavailable_reason("weight_quant_matmul", x, lambda: _fused_limits(x, codes, scheme))


def _fused_limits(x: Tensor, codes: Tensor, scheme: str) -> Optional[str]:
    if scheme != "int8":
        return f"{scheme} weights have no torch_npu matmul (npu_weight_quant_batchmatmul takes int8 or int4 codes)"
    if x.dtype not in _FUSED_DTYPES:
        return f"npu_weight_quant_batchmatmul takes fp16/bf16 inputs, not {x.dtype}"
    n, k = codes.shape
    if max(k, n) > _FUSED_MAX_INNER:
        return f"K={k} or N={n} exceeds npu_weight_quant_batchmatmul's limit (<= {_FUSED_MAX_INNER})"
    why = "older releases are not validated for this training path"
    return release_unsupported_reason("npu_weight_quant_batchmatmul", _FUSED_MIN_RELEASE, why) or (
        chip_unsupported_reason("npu_weight_quant_batchmatmul"))


class _QuantizedMatmul(torch.autograd.Function):
    """Forward fused or decoded; backward ``grad @ W`` with ``W`` decoded again; no gradient for codes or scales."""

    @staticmethod
    def forward(ctx, x: Tensor, codes: Tensor, scales: Tensor, scheme: str, fused: bool) -> Tensor:
        ctx.save_for_backward(codes, scales)
        ctx.scheme = scheme
        if fused:
            import torch_npu

            # x as (M, K); the weight as the transposed view (K, N) of its [N, K] codes, which the docs recommend
            # for per-channel scales; the scale (N,) in x's dtype, as the op requires.
            out = torch_npu.npu_weight_quant_batchmatmul(
                x.reshape(-1, x.shape[-1]), codes.t(), scales.to(x.dtype))
            return out.reshape(*x.shape[:-1], codes.shape[0])
        return F.linear(x, dequantize(codes, scales.to(x.dtype), scheme, x.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None]:
        codes, scales = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = grad @ dequantize(codes, scales.to(grad.dtype), ctx.scheme, grad.dtype)
        return dx, None, None, None, None


def reference_quantized_linear(x: Tensor, codes: Tensor, scales: Tensor, scheme: str,
                               bias: Optional[Tensor] = None) -> Tensor:
    """:func:`quantized_linear` on its decode-then-matmul path whatever the device: what the fused op must match."""
    out = _QuantizedMatmul.apply(x, codes, scales, scheme, False)
    return out if bias is None else out + bias.to(out.dtype)
