"""Rotary position embedding (RoPE), HF/LLaMA "half" convention.

The head dimension is split into halves (x1, x2); position p rotates the pair (x1[i], x2[i]) by angle
p * theta**(-2i/head_dim). Tables from :func:`rotary_tables` repeat the frequencies for both halves, so
``apply_rotary(x) = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``.
On NPU tensors this runs torch_npu.npu_rotary_mul; elsewhere plain PyTorch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_npu.kernels._dispatch import chip_unsupported_reason, note_fallback, unavailable_reason

# npu_rotary_mul's documented limits (half mode, torch_npu 2.6.0 .. 2.14.0 _op_plugin_docs.py): head_dim < 896,
# batch and heads < 1000 each, and "when the cos/sin gradients are computed, B*N <= 1024". Its backward
# (npu_rotary_mul_backward) always returns the cos/sin gradients, so the last limit holds for every backward.
_FUSED_MAX_HEAD_DIM = 895
_FUSED_MAX_BATCH_OR_HEADS = 999
_FUSED_MAX_BACKWARD_BATCH_X_HEADS = 1024


def rotary_tables(
    seq_len: int,
    head_dim: int,
    *,
    theta: float = 10000.0,
    start: int = 0,
    device: Optional[torch.device | str] = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Return (cos, sin), each [seq_len, head_dim], for token positions start .. start + seq_len - 1.

    Angles are computed in fp32 and only then cast to ``dtype``, so bf16 tables are correctly rounded.
    """
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even number for rotary embedding; got {head_dim}.")
    if seq_len < 0 or start < 0:
        raise ValueError(f"seq_len and start must be non-negative; got seq_len={seq_len}, start={start}.")
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [batch, seq, heads, head_dim] (BSND) by tables cos/sin [seq, head_dim]; returns x's dtype.

    The tables are cast to x's dtype first (as HF LLaMA does), so the output keeps x's dtype.
    """
    reason = why_not_fused(x, cos, sin)
    if reason is None:
        import torch_npu

        return torch_npu.npu_rotary_mul(x, *_broadcast_tables(x, cos, sin))
    note_fallback("rotary", x, reason)
    return reference_rotary(x, cos, sin)


def reference_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rotary` on its PyTorch path whatever the device: what the fused op must match."""
    cos, sin = _broadcast_tables(x, cos, sin)
    return x * cos + _rotate_half(x) * sin


def why_not_fused(x: Tensor, cos: Tensor, sin: Tensor) -> Optional[str]:
    """Why :func:`apply_rotary` would run the reference path on these inputs; None when it runs the fused op."""
    return unavailable_reason("rotary", x, lambda: _fused_limits(x, cos, sin))


def _broadcast_tables(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Check x against [seq, head_dim] tables; return them in x's dtype, shaped 1S1D to broadcast over BSND."""
    if x.dim() != 4:
        raise ValueError(f"apply_rotary expects a 4-D BSND tensor [batch, seq, heads, head_dim]; got {tuple(x.shape)}.")
    expected = (x.shape[1], x.shape[3])
    if tuple(cos.shape) != expected or tuple(sin.shape) != expected:
        raise ValueError(
            f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [seq, head_dim] = {expected} "
            f"for x {tuple(x.shape)}; build them with rotary_tables(seq_len={x.shape[1]}, head_dim={x.shape[3]}, "
            "start=<first position>)."
        )
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"head_dim must be even for rotary embedding; got x shape {tuple(x.shape)}.")
    return cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]


def _fused_limits(x: Tensor, cos: Tensor, sin: Tensor) -> Optional[str]:
    if x.shape[-1] > _FUSED_MAX_HEAD_DIM:
        return f"head_dim={x.shape[-1]} exceeds npu_rotary_mul's limit (< 896)"
    batch, heads = x.shape[0], x.shape[2]
    if batch > _FUSED_MAX_BATCH_OR_HEADS or heads > _FUSED_MAX_BATCH_OR_HEADS:
        return f"batch={batch} or heads={heads} exceeds npu_rotary_mul's limit (< 1000)"
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (x, cos, sin))
    if backward and batch * heads > _FUSED_MAX_BACKWARD_BATCH_X_HEADS:
        return (
            f"batch x heads = {batch} x {heads} = {batch * heads} exceeds npu_rotary_mul's backward limit"
            f" ({_FUSED_MAX_BACKWARD_BATCH_X_HEADS}); a smaller micro-batch keeps the fused kernel"
        )
    return chip_unsupported_reason("npu_rotary_mul")


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
