"""Attention computed block by block through its softmax statistics: the building block of ring attention.

A block is one query chunk against one key/value chunk: ``forward`` gives its output with each query row's maximum
score and sum of exponentials (fp32), :func:`merge` folds a block into a running output through those statistics,
and ``backward`` rebuilds a block's softmax from the merged statistics (flash-attention style) to give its
gradients. On NPU tensors a block is ``npu_fusion_attention`` (its ``softmax_max`` / ``softmax_sum`` outputs) and its
backward ``npu_fusion_attention_grad`` given the merged statistics; elsewhere an exact fp32 block in PyTorch.
``lightning_npu.parallel.context`` runs them around a ring of ranks; :func:`ring_step_attention` runs one ring
step's pair of blocks on one rank, which ``lightning-npu selftest`` checks against plain causal attention.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_npu.kernels import attention as _attention


class Block:
    """One block of ring attention: ``forward(q, k, v, causal, scale)`` -> (out, row max, row sum of exp), the
    statistics fp32 [B, H, Sq]; ``backward(q, k, v, dout, out, row_max, row_sum, causal, scale)`` -> (dq, dk, dv)
    with the softmax rebuilt from the (merged) statistics and ``out`` the merged output. ``causal``: the bottom-right
    mask of the diagonal block (q and k/v the same tokens); otherwise every query sees every key."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def backward(self, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, row_max: Tensor, row_sum: Tensor,
                 causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError


class _ReferenceBlock(Block):
    """The exact block in fp32 PyTorch (any device)."""

    def forward(self, q, k, v, causal, scale):
        scores, values = self._scores(q, k, v, causal, scale)
        row_max = scores.amax(dim=-1)
        weights = torch.exp(scores - row_max[..., None])
        row_sum = weights.sum(dim=-1)
        out = torch.matmul(weights / row_sum[..., None], values).transpose(1, 2)
        return out, row_max, row_sum

    def backward(self, q, k, v, dout, out, row_max, row_sum, causal, scale):
        scores, values = self._scores(q, k, v, causal, scale)
        probs = torch.exp(scores - row_max[..., None]) / row_sum[..., None]
        keys = _grouped(k, q.shape[2]).float().transpose(1, 2)
        do, o = dout.float().transpose(1, 2), out.float().transpose(1, 2)
        dv = torch.matmul(probs.transpose(-1, -2), do)
        ds = probs * (torch.matmul(do, values.transpose(-1, -2)) - (do * o).sum(dim=-1, keepdim=True))
        dq = torch.matmul(ds, keys) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.float().transpose(1, 2)) * scale
        kv_heads = k.shape[2]
        dk, dv = (_per_kv_head(grad, kv_heads).transpose(1, 2) for grad in (dk, dv))
        return dq.transpose(1, 2), dk, dv

    @staticmethod
    def _scores(q, k, v, causal, scale):
        heads = q.shape[2]
        keys = _grouped(k, heads).float().transpose(1, 2)
        values = _grouped(v, heads).float().transpose(1, 2)
        scores = torch.matmul(q.float().transpose(1, 2), keys.transpose(-1, -2)) * scale
        if causal:
            sq, skv = q.shape[1], k.shape[1]
            rows = torch.arange(sq, device=q.device)[:, None] + (skv - sq)
            scores = scores.masked_fill(torch.arange(skv, device=q.device)[None, :] > rows, float("-inf"))
        return scores, values


def _grouped(kv: Tensor, heads: int) -> Tensor:
    return kv.repeat_interleave(heads // kv.shape[2], dim=2)


def _per_kv_head(grad: Tensor, kv_heads: int) -> Tensor:
    """[B, H, S, D] gradients of the repeated key/value heads -> [B, kv_heads, S, D] (each group summed)."""
    b, h, s, d = grad.shape
    return grad.reshape(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


class _NPUBlock(Block):
    """``npu_fusion_attention`` BSND (sparse_mode 3 with the compressed mask on the diagonal block, no mask
    elsewhere) and its ``npu_fusion_attention_grad`` given the merged softmax_max / softmax_sum."""

    def forward(self, q, k, v, causal, scale):
        out, softmax_max, softmax_sum = _attention.fusion_attention(
            q, k, v, scale, layout="BSND", heads=q.shape[2], **self._mask(q, causal))
        # [B, N, Sq, 8]: the statistic repeated over the last dimension.
        return out, softmax_max[..., 0], softmax_sum[..., 0]

    def backward(self, q, k, v, dout, out, row_max, row_sum, causal, scale):
        shape = (*row_max.shape, 8)
        return _attention.fusion_attention_grad(
            q, k, v, dout.to(q.dtype), out.to(q.dtype), row_max[..., None].expand(shape).contiguous(),
            row_sum[..., None].expand(shape).contiguous(), scale, layout="BSND", heads=q.shape[2],
            **self._mask(q, causal))

    @staticmethod
    def _mask(q: Tensor, causal: bool) -> dict[str, Any]:
        if not causal:
            return {}  # without atten_mask the op attends to every key
        return {"atten_mask": _attention._compressed_causal_mask(q.device),
                "sparse_mode": _attention._SPARSE_MODE_RIGHT_DOWN_CAUSAL}


REFERENCE_BLOCK = _ReferenceBlock()
NPU_BLOCK = _NPUBlock()


def block_for(q: Tensor, k: Tensor, v: Tensor) -> tuple[Block, Optional[str]]:
    """The block that computes on these inputs (the NPU's where it can run fused), and why not the NPU's (None
    when it is)."""
    reason = why_not_fused_ring(q, k, v)
    return (NPU_BLOCK if reason is None else REFERENCE_BLOCK), reason


def merge(out: Tensor, row_max: Tensor, row_sum: Tensor, rows: slice, block: tuple[Tensor, Tensor, Tensor]) -> None:
    """Merge a block's (out, max, sum) into the running fp32 ones at query ``rows``, in place:
    m = max(m1, m2), s = s1 e^(m1 - m) + s2 e^(m2 - m), out = (out1 s1 e^(m1 - m) + out2 s2 e^(m2 - m)) / s."""
    block_out, block_max, block_sum = block
    old_max, old_sum = row_max[:, :, rows], row_sum[:, :, rows]
    new_max = torch.maximum(old_max, block_max)
    old_weight = old_sum * torch.exp(old_max - new_max)
    block_weight = block_sum * torch.exp(block_max - new_max)
    new_sum = old_weight + block_weight
    # [B, H, Sq] -> [B, Sq, H, 1] to scale BSND outputs.
    old_scale, block_scale = ((w / new_sum).transpose(1, 2)[..., None] for w in (old_weight, block_weight))
    out[:, rows] = out[:, rows] * old_scale + block_out.float() * block_scale
    row_max[:, :, rows], row_sum[:, :, rows] = new_max, new_sum


def ring_step_attention(q: Tensor, k_before: Tensor, v_before: Tensor, k: Tensor, v: Tensor, *,
                        scale: Optional[float] = None) -> Tensor:
    """Ring attention's kernels on one rank: ``q``'s causal attention over earlier keys (``k_before``, every query
    sees them: a block received from another rank) and its own (``k``, the causal diagonal), the two blocks merged
    through their softmax statistics and differentiated from the merged ones, as a ring step does. It equals
    :func:`~lightning_npu.kernels.causal_attention` over the concatenated keys: ``lightning-npu selftest`` checks the
    ring's NPU blocks (npu_fusion_attention, npu_fusion_attention_grad) against that reference."""
    _attention._check_inputs(q, k, v)
    _attention._check_inputs(q, k_before, v_before)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    block, _ = block_for(q, k, v)
    return _MergedBlocks.apply(q, k_before, v_before, k, v, scale, block)


def why_not_fused_ring(q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    """Why ring attention's blocks would run the exact PyTorch block on these inputs; None when they run fused."""
    return _attention.why_not_fused(q, k, v)


class _MergedBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k_before: Tensor, v_before: Tensor, k: Tensor, v: Tensor, scale: float,
                block: Block) -> Tensor:
        b, length, heads, _ = q.shape
        out = torch.zeros(b, length, heads, v.shape[-1], dtype=torch.float32, device=q.device)
        row_max = torch.full((b, heads, length), float("-inf"), dtype=torch.float32, device=q.device)
        row_sum = torch.zeros(b, heads, length, dtype=torch.float32, device=q.device)
        for keys, values, causal in ((k_before, v_before, False), (k, v, True)):
            merge(out, row_max, row_sum, slice(None), block.forward(q, keys, values, causal, scale))
        ctx.save_for_backward(q, k_before, v_before, k, v, out, row_max, row_sum)
        ctx.scale, ctx.block = scale, block
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor):
        q, k_before, v_before, k, v, out, row_max, row_sum = ctx.saved_tensors
        dout = dout.contiguous()
        before = ctx.block.backward(q, k_before, v_before, dout, out, row_max, row_sum, False, ctx.scale)
        own = ctx.block.backward(q, k, v, dout, out, row_max, row_sum, True, ctx.scale)
        return ((before[0].float() + own[0].float()).to(q.dtype), before[1].to(k.dtype), before[2].to(v.dtype),
                own[1].to(k.dtype), own[2].to(v.dtype), None, None)


__all__ = ["Block", "NPU_BLOCK", "REFERENCE_BLOCK", "block_for", "merge", "ring_step_attention", "why_not_fused_ring"]
