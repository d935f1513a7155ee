"""Causal (GQA-capable) attention: torch_npu.npu_fusion_attention on NPU tensors, SDPA elsewhere.

Layout is BSND throughout: q / k [batch, q_len | kv_len, heads, head_dim], v [batch, kv_len, kv_heads, v_head_dim]
with ``v_head_dim <= head_dim`` (MLA: DeepSeek's q/k heads of 192 and v heads of 128); the output has v's head dim.
The causal mask is aligned bottom-right: query i sees keys j <= i + (kv_len - q_len), so the last query
row always sees every key. With q_len == kv_len this is the usual training mask; with q_len < kv_len it
is what KV-cached decoding needs (the new tokens sit at the end of the cache).

npu_fusion_attention documents Dq == Dk >= Dv, but CANN releases before 8.2.RC1 may reject Dv < Dk (MindSpeed-LLM
pads there and needs CANN >= 8.2.RC1 for ``--mla-fa-without-pad``): on those, and where the CANN version cannot be
read, v is zero-padded to Dk and the output sliced back, which is exact (the padded columns of the output are 0 and
get no gradient). Which of the two paths runs is logged once.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_npu.kernels._dispatch import chip_unsupported_reason, log, note_fallback, unavailable_reason
from lightning_npu.runtime.probe import release

# npu_fusion_attention's documented limits (Atlas A2 training series).
_FUSED_MAX_HEAD_DIM = 768
_FUSED_MAX_Q_HEADS = 256
# Causal sparse modes (2, 3) take this fixed "compressed" mask instead of a full [Sq, Skv] one.
_COMPRESSED_MASK_SIZE = 2048
# sparse_mode 3 = right-down causal: the bottom-right alignment documented above.
_SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3
# The first CANN release whose npu_fusion_attention takes Dv < Dk unpadded (MindSpeed-LLM's --mla-fa-without-pad).
_UNPADDED_VALUE_HEAD_DIM_CANN = (8, 2)
_cann: dict[str, Optional[str]] = {}
_announced_value_paths: set[str] = set()


def causal_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None) -> Tensor:
    """Causal softmax attention in BSND layout; returns [batch, q_len, q_heads, v_head_dim] in q's dtype.

    ``q_heads`` must be a multiple of ``kv_heads`` (grouped-query attention: each group of
    q_heads // kv_heads query heads shares one key/value head). v's head dim may be smaller than q's and k's
    (MLA). ``scale`` multiplies q·k before the softmax and defaults to 1/sqrt(head_dim) (q's); pass the model's
    own (DeepSeek's yarn-scaled one) explicitly.
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
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree on batch, kv_len and kv_heads (dims 0-2); got k {tuple(k.shape)} and v {tuple(v.shape)}."
        )
    if v.shape[3] > k.shape[3]:
        raise ValueError(
            f"v's head_dim={v.shape[3]} exceeds q/k's head_dim={k.shape[3]}: npu_fusion_attention takes Dq == Dk >= Dv"
            " only (MLA's v heads are the smaller ones, e.g. q/k 192 and v 128). Pass v with at most k's head dim, or"
            " zero-pad q and k to v's head dim (which leaves q·k unchanged) and pass the scale explicitly."
        )
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
    return fusion_attention(q, k, v, scale, layout=layout, heads=heads, atten_mask=_compressed_causal_mask(q.device),
                            sparse_mode=_SPARSE_MODE_RIGHT_DOWN_CAUSAL, **varlen)[0]


def fusion_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, *, layout: str, heads: int,
                     **options: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``npu_fusion_attention`` (``options``: its mask, sparse mode and varlen arguments) -> (out, softmax_max,
    softmax_sum), ``out`` with v's head dim: v zero-padded to Dk and the output sliced where the CANN release needs
    it (:func:`value_padding`)."""
    import torch_npu

    pad = value_padding(k.shape[-1], v.shape[-1])
    out, softmax_max, softmax_sum = torch_npu.npu_fusion_attention(
        q, k, _padded(v, pad), head_num=heads, input_layout=layout, scale=scale, **options)[:3]
    return _sliced(out, pad), softmax_max, softmax_sum


def fusion_attention_grad(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, softmax_max: Tensor,
                          softmax_sum: Tensor, scale: float, *, layout: str, heads: int,
                          **options: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``npu_fusion_attention_grad`` from (merged) softmax statistics -> (dq, dk, dv), for ``out`` / ``dout`` with
    v's head dim: v, out and dout zero-padded to Dk and dv sliced where :func:`fusion_attention` pads (exact: the
    padded columns of out and dout are 0, so the softmax gradient and dq, dk are unchanged)."""
    import torch_npu

    pad = value_padding(k.shape[-1], v.shape[-1])
    dq, dk, dv = torch_npu.npu_fusion_attention_grad(
        q, k, _padded(v, pad), _padded(dout, pad), heads, layout, softmax_max=softmax_max, softmax_sum=softmax_sum,
        attention_in=_padded(out, pad), scale_value=scale, **options)[:3]
    return dq, dk, _sliced(dv, pad)


def value_padding(head_dim: int, v_head_dim: int) -> int:
    """How many zero columns v needs for this CANN's npu_fusion_attention: 0 when Dv == Dk or CANN >= 8.2.RC1, else
    Dk - Dv (CANN older, or its version unreadable: padding is exact, only slower). Logs once which path runs."""
    if v_head_dim == head_dim:
        return 0
    if "version" not in _cann:
        from lightning_npu.doctor.cann import find_cann

        found = find_cann(os.environ)
        _cann["version"] = None if found is None else found.version
    version = _cann["version"]
    unpadded = version is not None and release(version)[:2] >= _UNPADDED_VALUE_HEAD_DIM_CANN
    path = "unpadded" if unpadded else "padded"
    if path not in _announced_value_paths:
        _announced_value_paths.add(path)
        cann = f"CANN {version}" if version is not None else "a CANN whose version could not be read"
        if unpadded:
            log.info("npu_fusion_attention takes v's head dim %d < q/k's %d unpadded on %s (>= 8.2.RC1)",
                     v_head_dim, head_dim, cann)
        else:
            log.warning("npu_fusion_attention: v's head dim %d < q/k's %d on %s (unpadded needs CANN >= 8.2.RC1):"
                        " v zero-padded to %d and the output sliced (exact, more memory and time)", v_head_dim,
                        head_dim, cann, head_dim)
    return 0 if unpadded else head_dim - v_head_dim


def _padded(x: Tensor, pad: int) -> Tensor:
    return F.pad(x, (0, pad)) if pad else x


def _sliced(x: Tensor, pad: int) -> Tensor:
    return x[..., : x.shape[-1] - pad] if pad else x


@functools.lru_cache(maxsize=None)
def _compressed_causal_mask(device: torch.device) -> Tensor:
    # True = masked out (torch_npu's polarity, the inverse of SDPA's boolean mask).
    ones = torch.ones(_COMPRESSED_MASK_SIZE, _COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None) -> Tensor:
    """:func:`causal_attention` on its PyTorch path (SDPA, which takes v's own head dim) whatever the device: what
    the fused op must match."""
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
    # SDPA's fused kernels take v at q's head dim only; on its math path autograd keeps the scores [S, S] for the
    # backward. When it records, zero columns keep the fused path (exact up to rounding: they are sliced off), so
    # training holds what the NPU kernel holds; without a graph the unpadded math path is transformers' own.
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    pad = q.shape[-1] - v.shape[-1] if recording else 0
    vt = _padded(vt, pad)
    if sq == skv:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        # SDPA's is_causal aligns top-left; decoding needs bottom-right, so build it (True = attend).
        rows = torch.arange(sq, device=q.device)[:, None] + (skv - sq)
        cols = torch.arange(skv, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=cols <= rows, scale=scale)
    return _sliced(out, pad).transpose(1, 2)
