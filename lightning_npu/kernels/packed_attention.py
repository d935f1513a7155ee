"""Causal attention over packed sequences (document masking): no token attends across a sample boundary.

Layout is TND (packed tokens): q [T, q_heads, head_dim], k/v [T, kv_heads, head_dim], the samples laid end to
end along T. ``cu_seqlens`` are the cumulative sample boundaries ``[0, end_1, ..., T]`` (a host list of ints,
or a 1-D integer tensor, read once with ``.tolist()``: on an NPU tensor that is one device sync, so pass a list
when you have one). Token t of a sample sees the tokens of the same sample at positions <= t, as if the sample ran
alone through :func:`~lightning_npu.kernels.causal_attention`.

On NPU tensors this is ``npu_fusion_attention`` in its varlen ``TND`` layout (``actual_seq_qlen`` /
``actual_seq_kvlen`` = the boundaries without the leading 0, sparse_mode 3 with the compressed causal mask);
elsewhere, and where the fused op is documented not to work, each sample runs through SDPA on its own slice.
``LIGHTNING_NPU_DISABLE_FUSED=attention`` turns this kernel's fused op off too (it is the same torch_npu op).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_npu.kernels import _dispatch
from lightning_npu.kernels.attention import (
    _check_inputs,
    _fused_limits,
    npu_causal_fusion_attention,
    reference_attention,
)

# npu_fusion_attention's documented varlen limits (torch_npu/_op_plugin_docs.py, 2.13.0 / 2.14.0 wheels):
# T in 1..1M ("varlen场景下: 要求T(B*S)取值范围1~1M", :1684) and at most 1K samples ("varlen场景下长度最大支持1K",
# :1694; 2.6.0 allows 2K, :1284, so 1K holds on every release).
_FUSED_MAX_TOKENS = 1024 * 1024
_FUSED_MAX_SAMPLES = 1024

SeqLens = Union[Sequence[int], Tensor]


def packed_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: SeqLens, *, scale: Optional[float] = None
) -> Tensor:
    """Per-sample causal attention over packed TND tensors; returns [T, q_heads, head_dim] in q's dtype.

    ``q_heads`` must be a multiple of ``kv_heads`` (grouped-query attention). ``cu_seqlens`` starts at 0, rises
    strictly (no empty sample) and ends at T. ``scale`` multiplies q·k before the softmax and defaults to
    1/sqrt(head_dim).
    """
    bounds = _check_packed_inputs(q, k, v, cu_seqlens)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    reason = why_not_fused(q, k, v, bounds)
    if reason is None:
        return _npu_packed_attention(q, k, v, bounds, scale)
    if _dispatch._on_npu(q):
        _dispatch.log_fallback_once("packed_causal_attention", reason)
    return reference_packed_attention(q, k, v, bounds, scale=scale)


def why_not_fused(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: SeqLens) -> Optional[str]:
    """Why :func:`packed_causal_attention` would run the reference path; None when it runs the fused op."""
    bounds = _as_list(cu_seqlens)
    return _dispatch.unavailable_reason("attention", q, lambda: _fused_limits_packed(q, bounds))


def reference_packed_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: SeqLens, *, scale: Optional[float] = None
) -> Tensor:
    """:func:`packed_causal_attention` on its PyTorch path whatever the device: each sample alone through SDPA.

    Exact by construction (no cross-sample term is ever computed) and O(sum of squared sample lengths), where one
    SDPA call over the whole row with a block-diagonal mask would cost O(T^2) time and a [T, T] mask.
    """
    bounds = _as_list(cu_seqlens)
    outs = [
        reference_attention(q[start:end][None], k[start:end][None], v[start:end][None], scale=scale)[0]
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs)


def _as_list(cu_seqlens: SeqLens) -> list[int]:
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor or a list of ints; got a {cu_seqlens.dim()}-D "
                f"{cu_seqlens.dtype} tensor. Pass the cumulative sample boundaries, e.g. [0, 3, 7] for lengths 3 and 4."
            )
        return [int(b) for b in cu_seqlens.tolist()]
    bounds = list(cu_seqlens)
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        raise ValueError(f"cu_seqlens must hold ints; got {bounds!r}. Pass e.g. [0, 3, 7] for lengths 3 and 4.")
    return bounds


def _check_packed_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: SeqLens) -> list[int]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"packed_causal_attention expects 3-D TND tensors [tokens, heads, head_dim]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}. Flatten a [batch, seq, heads, head_dim] batch with .flatten(0, 1)."
        )
    if k.shape[0] != q.shape[0]:
        raise ValueError(
            f"q holds {q.shape[0]} tokens but k {k.shape[0]}: packed self-attention takes q, k and v of the same "
            "packed tokens (one cu_seqlens for all three)."
        )
    # The rest (k == v, head_dim, GQA ratio, dtypes) is causal_attention's rule, on the packed row as a batch of one.
    _check_inputs(q[None], k[None], v[None])
    bounds = _as_list(cu_seqlens)
    total = q.shape[0]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"cu_seqlens={bounds} must start at 0 and end at the token count T={total} (q.shape[0]): the cumulative "
            "sample boundaries, e.g. [0, 3, 7] for samples of 3 and 4 tokens."
        )
    empty = [i for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b <= a]
    if empty:
        raise ValueError(
            f"cu_seqlens={bounds} must rise strictly: sample {empty[0]} has length "
            f"{bounds[empty[0] + 1] - bounds[empty[0]]}. Drop empty samples (repeated boundaries) before packing."
        )
    return bounds


def _fused_limits_packed(q: Tensor, bounds: list[int]) -> Optional[str]:
    samples = len(bounds) - 1
    if q.shape[0] > _FUSED_MAX_TOKENS:
        return f"T={q.shape[0]} packed tokens exceed npu_fusion_attention's varlen limit of {_FUSED_MAX_TOKENS}"
    if samples > _FUSED_MAX_SAMPLES:
        return f"{samples} packed samples exceed npu_fusion_attention's varlen limit of {_FUSED_MAX_SAMPLES}"
    return _fused_limits(q[None])  # head_dim, q_heads and chip, read from the BSND view [1, T, heads, head_dim]


def _npu_packed_attention(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], scale: float) -> Tensor:
    # Cumulative ends without cu_seqlens' leading 0, as host ints (int[] in the op schema).
    ends = bounds[1:]
    return npu_causal_fusion_attention(q, k, v, scale, layout="TND", heads=q.shape[1], actual_seq_qlen=ends,
                                       actual_seq_kvlen=ends)
