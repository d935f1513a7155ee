"""Causal (GQA-capable) attention: torch_npu.npu_fusion_attention on NPU tensors, SDPA elsewhere.

Layout is BSND throughout: q [batch, q_len, q_heads, head_dim], k/v [batch, kv_len, kv_heads, head_dim].
The causal mask is aligned bottom-right: query i sees keys j <= i + (kv_len - q_len), so the last query
row always sees every key. With q_len == kv_len this is the usual training mask; with q_len < kv_len it
is what KV-cached decoding needs (the new tokens sit at the end of the cache).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_npu.kernels._dispatch import chip_unsupported_reason, note_fallback, unavailable_reason

# npu_fusion_attention's documented limits (Atlas A2 training series).
_FUSED_MAX_HEAD_DIM = 768
_FUSED_MAX_Q_HEADS = 256
# Causal sparse modes (2, 3) take this fixed "compressed" mask instead of a full [Sq, Skv] one.
_COMPRESSED_MASK_SIZE = 2048
# sparse_mode 3 = right-down causal: the bottom-right alignment documented above.
_SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3


def causal_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None) -> Tensor:
    """Causal softmax attention in BSND layout; returns [batch, q_len, q_heads, head_dim] in q's dtype.

    ``q_heads`` must be a multiple of ``kv_heads`` (grouped-query attention: each group of
    q_heads // kv_heads query heads shares one key/value head). ``scale`` multiplies q·k before the
    softmax and defaults to 1/sqrt(head_dim).
    """
    _check_inputs(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    reason = why_not_fused(q, k, v)
    if reason is None:
        return _npu_attention(q, k, v, scale)
    note_fallback("attention", q, reason)
    return reference_attention(q, k, v, scale=scale)


def why_not_fused(q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    """Why :func:`causal_attention` would run the reference path on these inputs; None when it runs the fused op."""
    return unavailable_reason("attention", q, lambda: _fused_limits(q))


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"causal_attention expects 4-D BSND tensors [batch, seq, heads, head_dim]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}. Reshape with .view(batch, seq, heads, head_dim)."
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}.")
    b, sq, hq, d = q.shape
    bk, skv, hkv, dk = k.shape
    if b != bk or d != dk:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch (dim 0) and head_dim (dim 3) "
            "in BSND layout [batch, seq, heads, head_dim]."
        )
    if hq % hkv != 0:
        raise ValueError(
            f"q_heads={hq} is not a multiple of kv_heads={hkv}; grouped-query attention needs "
            f"q_heads % kv_heads == 0 (e.g. kv_heads in the divisors of {hq})."
        )
    if sq > skv:
        raise ValueError(
            f"q_len={sq} exceeds kv_len={skv}: with the causal mask aligned bottom-right, the first "
            f"{sq - skv} query rows would see no key. Pass at least as many keys as queries "
            "(k/v include the cached prefix plus the new tokens)."
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them with .to(q.dtype)."
        )


def _fused_limits(q: Tensor) -> Optional[str]:
    head_dim, q_heads = q.shape[-1], q.shape[2]
    if head_dim > _FUSED_MAX_HEAD_DIM:
        return f"head_dim={head_dim} exceeds npu_fusion_attention's limit of {_FUSED_MAX_HEAD_DIM}"
    if q_heads > _FUSED_MAX_Q_HEADS:
        return f"q_heads={q_heads} exceeds npu_fusion_attention's limit of {_FUSED_MAX_Q_HEADS}"
    return chip_unsupported_reason("npu_fusion_attention")


def _npu_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return npu_causal_fusion_attention(q, k, v, scale, layout="BSND", heads=q.shape[2])


def npu_causal_fusion_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, *, layout: str, heads: int,
                                **varlen: list[int]) -> Tensor:
    """Right-down causal ``npu_fusion_attention`` in ``layout`` (BSND; or TND with ``actual_seq_qlen`` /
    ``actual_seq_kvlen`` for packed samples): the one call both attention kernels make; the output only."""
    import torch_npu

    return torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        head_num=heads,
        input_layout=layout,
        atten_mask=_compressed_causal_mask(q.device),
        scale=scale,
        sparse_mode=_SPARSE_MODE_RIGHT_DOWN_CAUSAL,
        **varlen,
    )[0]


@functools.lru_cache(maxsize=None)
def _compressed_causal_mask(device: torch.device) -> Tensor:
    # True = masked out (torch_npu's polarity, the inverse of SDPA's boolean mask).
    ones = torch.ones(_COMPRESSED_MASK_SIZE, _COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None) -> Tensor:
    """:func:`causal_attention` on its PyTorch path (SDPA) whatever the device: what the fused op must match."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    sq, skv = q.shape[1], k.shape[1]
    q_heads, kv_heads = q.shape[2], k.shape[2]
    # SDPA wants BNSD.
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q_heads != kv_heads:
        # Expanding k/v costs memory, but works on every SDPA backend and torch version.
        group = q_heads // kv_heads
        kt = kt.repeat_interleave(group, dim=1)
        vt = vt.repeat_interleave(group, dim=1)
    if sq == skv:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        # SDPA's is_causal aligns top-left; decoding needs bottom-right, so build it (True = attend).
        rows = torch.arange(sq, device=q.device)[:, None] + (skv - sq)
        cols = torch.arange(skv, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=cols <= rows, scale=scale)
    return out.transpose(1, 2)
