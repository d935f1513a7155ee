"""Causal attention over a sequence split across the ranks of a context-parallel group: Ulysses and ring.

Each rank of the group holds ``1 / cp`` of every sequence (all its layers' activations are that size); attention is
the one place a token needs the others. :class:`ContextParallel` is what a model is given for it (npu_fsdp's
``context_parallel_size``): which part of a sequence this rank holds (:meth:`ContextParallel.shard`, the same rule
for token ids, labels and positions), and attention over the whole sequence from those parts
(:meth:`ContextParallel.attention`, BSND in and out, like :func:`~lightning_npu.kernels.causal_attention`).

- ``"ulysses"`` (DeepSpeed-Ulysses): rank ``i`` holds the ``i``-th contiguous chunk. An all-to-all turns
  [batch, seq / cp, heads, head_dim] into [batch, seq, heads / cp, head_dim]: each rank then runs the existing causal
  kernel (``causal_attention``, or ``packed_causal_attention`` for packed rows, so npu_fusion_attention BSND / TND
  with sparse_mode 3 on NPUs) on whole sequences for its share of the heads, and a second all-to-all brings the
  output back. Four all-to-alls per layer forward (q, k, v, out); the heads must divide by cp, and key/value heads
  are repeated where cp does not divide them.
- ``"ring"``: the sequence is cut into ``2 cp`` chunks and rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``
  (head-tail: under the causal mask every rank then does the same work). Keys and values travel around the ring
  (``cp - 1`` exchanges, overlapped with the blocks' compute); each block's output is merged into the running one
  through its softmax statistics (row max and row sum of exp, fp32). Backward recomputes each block's softmax from
  the merged statistics (flash-attention style) and sends the key/value gradients around the ring after them. On NPU
  tensors a block is ``npu_fusion_attention`` (its ``softmax_max`` / ``softmax_sum`` outputs) and its backward
  ``npu_fusion_attention_grad`` with the merged statistics; elsewhere an exact fp32 block in PyTorch. Any head count
  works; packed rows are refused (a sample would cross the chunk boundaries).

Ulysses moves ``4 x`` the layer's q/k/v-sized activations per layer but only inside attention and needs
``heads % cp == 0``; ring moves ``2 (cp - 1) / cp`` of the key/value sequence per layer, overlapped with compute, and
scales past the head count (long contexts: 128k over cp = 8 with 8 KV heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_npu.facts.options import CONTEXT_PARALLEL_ALGOS
from lightning_npu.kernels import attention as _attention
from lightning_npu.kernels._dispatch import note_fallback
from lightning_npu.kernels.packed_attention import packed_causal_attention


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group (``group``, ``cp`` ranks) and its algorithm (``"ulysses"`` or ``"ring"``)."""

    group: Any
    algo: str

    def __post_init__(self) -> None:
        if self.algo not in CONTEXT_PARALLEL_ALGOS:
            raise ValueError(f"context_parallel_algo={self.algo!r} is not one of {', '.join(CONTEXT_PARALLEL_ALGOS)}")

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of ``x`` along ``dim`` (the sequence): the ``rank``-th of ``cp`` contiguous chunks
        (Ulysses), or chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` (ring). The length must divide evenly."""
        parts = self.size if self.algo == "ulysses" else 2 * self.size
        length = x.shape[dim]
        if length % parts:
            raise ValueError(
                f"a sequence of {length} tokens does not split into {parts} equal parts ({self._split_rule()}); use a"
                f" sequence length that is a multiple of {parts}"
            )
        chunks = x.chunk(parts, dim=dim)
        if self.algo == "ulysses":
            return chunks[self.rank]
        return torch.cat((chunks[self.rank], chunks[parts - 1 - self.rank]), dim=dim)

    def positions(self, seq_len: int, device: Optional[torch.device] = None) -> Tensor:
        """The global positions (int64) of the tokens :meth:`shard` gives this rank of a ``seq_len`` sequence."""
        return self.shard(torch.arange(seq_len, device=device), dim=0)

    def token_mean(self, total: Tensor, count: Tensor) -> Tensor:
        """This rank's share of a mean over the whole sequences' tokens, from its own ``total`` (a sum over its
        tokens, e.g. of a loss) and ``count`` (how many it counted): ``cp x total / (the group's count)``. The group's
        average of it, which npu_fsdp's loss and gradient averaging take, is then the mean over every token of the
        group however unevenly they fall on the ranks (an SFT batch's labelled tokens), as without context
        parallelism."""
        count = count.detach().clone()
        dist.all_reduce(count, group=self.group)
        return total * self.size / count

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Optional[Sequence[int]] = None,
                  scale: Optional[float] = None) -> Tensor:
        """Causal attention of this rank's queries over the whole sequence; BSND in and out, this rank's tokens.

        ``q`` [batch, seq / cp, heads, head_dim], ``k`` / ``v`` [batch, seq / cp, kv_heads, head_dim] as
        :meth:`shard` cut them. ``cu_seqlens`` (Ulysses only): the packed samples' boundaries over the whole batch
        flattened (``[0, ..., batch * seq]``, the boundaries ``packed_causal_attention`` takes), so each sample
        attends within itself.
        """
        if self.algo == "ulysses":
            return ulysses_attention(q, k, v, self.group, cu_seqlens=cu_seqlens, scale=scale)
        if cu_seqlens is not None:
            raise ValueError(
                "context_parallel_algo='ring' does not take packed rows (cu_seqlens): its head-tail chunks cut samples"
                " at positions the ring's causal blocks do not know; use context_parallel_algo='ulysses' for packed SFT"
                " rows, or train without packing"
            )
        return ring_attention(q, k, v, self.group, scale=scale)

    def _split_rule(self) -> str:
        if self.algo == "ulysses":
            return f"Ulysses gives each of the {self.size} context-parallel ranks one contiguous chunk"
        return (f"ring attention gives each of the {self.size} context-parallel ranks two of {2 * self.size} chunks,"
                " one from each end, so that every rank does the same causal work")


# ---------------------------------------------------------------- Ulysses


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 split in equal parts; its own transpose, so backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: Tensor, group: Any) -> Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _sequence_to_heads(x: Tensor, group: Any, cp: int) -> Tensor:
    """[B, S / cp, H, D] (this rank's chunk, every head) -> [B, S, H / cp, D] (every chunk, this rank's heads)."""
    b, s, h, d = x.shape
    parts = x.view(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp: head group, B, s, H / cp, D]
    gathered = _AllToAll.apply(parts, group)  # [cp: source rank = sequence chunk, B, s, H / cp, D]
    return gathered.permute(1, 0, 2, 3, 4).reshape(b, cp * s, h // cp, d)


def _heads_to_sequence(x: Tensor, group: Any, cp: int) -> Tensor:
    """The inverse of :func:`_sequence_to_heads`: [B, S, H / cp, D] -> [B, S / cp, H, D]."""
    b, seq, h, d = x.shape
    parts = x.view(b, cp, seq // cp, h, d).permute(1, 0, 2, 3, 4)  # [cp: sequence chunk, B, s, H / cp, D]
    scattered = _AllToAll.apply(parts, group)  # [cp: source rank = head group, B, s, H / cp, D]
    return scattered.permute(1, 2, 0, 3, 4).reshape(b, seq // cp, cp * h, d)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: Any, *, cu_seqlens: Optional[Sequence[int]] = None,
                      scale: Optional[float] = None) -> Tensor:
    """Causal attention of sequence-sharded BSND tensors (rank ``i`` holds the ``i``-th contiguous chunk) through two
    all-to-alls around :func:`~lightning_npu.kernels.causal_attention` (or ``packed_causal_attention`` with
    ``cu_seqlens`` over the whole flattened batch); returns this rank's chunk of the output."""
    cp = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    check_ulysses_heads(heads, kv_heads, cp)
    # Each rank takes heads / cp query heads and must hold the key/value heads they read: repeat each key/value head
    # so that cp divides their number (lcm(kv_heads, cp) of them: the query heads still map onto them in groups).
    repeat = cp // math.gcd(kv_heads, cp)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    q, k, v = (_sequence_to_heads(t, group, cp) for t in (q, k, v))
    if cu_seqlens is None:
        out = _attention.causal_attention(q, k, v, scale=scale)
    else:
        b, seq, h = q.shape[:3]
        out = packed_causal_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, scale=scale)
        out = out.view(b, seq, h, v.shape[-1])
    return _heads_to_sequence(out, group, cp)


def check_ulysses_heads(heads: int, kv_heads: int, cp: int) -> None:
    """ValueError unless Ulysses can split ``heads`` query heads (a rank's, after tensor parallelism) over ``cp``."""
    if heads % cp:
        raise ValueError(
            f"context_parallel_algo='ulysses' splits the {heads} attention heads of each rank over"
            f" context_parallel_size={cp} ranks, which does not divide them; use a context_parallel_size that divides"
            f" {heads}, or context_parallel_algo='ring' (any head count)"
        )
    if heads % kv_heads:
        raise ValueError(
            f"{heads} query heads are not a multiple of {kv_heads} key/value heads (grouped-query attention)"
        )


# ---------------------------------------------------------------- ring


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: Any, *, scale: Optional[float] = None) -> Tensor:
    """Causal attention of head-tail sharded BSND tensors (rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` of
    ``2 cp``) by ring attention; returns this rank's part of the output, in q's dtype."""
    _attention._check_inputs(q, k, v)
    if q.shape[1] != k.shape[1] or q.shape[1] % 2:
        raise ValueError(
            f"ring attention takes this rank's two head-tail chunks of q, k and v (an even, equal length); got q"
            f" {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    reason = why_not_fused_ring(q, k, v)
    if reason is not None:
        note_fallback("attention", q, reason)
    block = _NPU_BLOCK if reason is None else _REFERENCE_BLOCK
    return _RingAttention.apply(q, k, v, group, scale, block)


class _Block:
    """One block of ring attention: ``forward(q, k, v, causal, scale)`` -> (out, row max, row sum of exp), the
    statistics fp32 [B, H, Sq]; ``backward(q, k, v, dout, out, row_max, row_sum, causal, scale)`` -> (dq, dk, dv)
    with the softmax rebuilt from the (merged) statistics and ``out`` the merged output. ``causal``: the bottom-right
    mask of the diagonal block (q and k/v the same tokens); otherwise every query sees every key."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def backward(self, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, row_max: Tensor, row_sum: Tensor,
                 causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError


class _ReferenceBlock(_Block):
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


class _NPUBlock(_Block):
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


_REFERENCE_BLOCK = _ReferenceBlock()
_NPU_BLOCK = _NPUBlock()


def _merge(out: Tensor, row_max: Tensor, row_sum: Tensor, rows: slice, block: tuple[Tensor, Tensor, Tensor]) -> None:
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


def _ring_steps(rank: int, cp: int, length: int):
    """Per ring step: the step, and which query rows meet which key/value rows of the block held then (the source
    rank's chunks), and whether that block is the causal diagonal. Local rows are [chunk rank; chunk 2cp-1-rank]."""
    half = length // 2
    for step in range(cp):
        source = (rank - step) % cp
        if step == 0:
            yield step, slice(None), slice(None), True  # own chunks: causal over the local order
        elif source < rank:
            yield step, slice(None), slice(0, half), False  # both query chunks follow the source's head chunk only
        else:
            yield step, slice(half, None), slice(None), False  # only the tail query chunk follows both of its chunks


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: Any, scale: float, block: _Block) -> Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, length, heads, d = q.shape
        out = torch.zeros(b, length, heads, v.shape[-1], dtype=torch.float32, device=q.device)
        row_max = torch.full((b, heads, length), float("-inf"), dtype=torch.float32, device=q.device)
        row_sum = torch.zeros(b, heads, length, dtype=torch.float32, device=q.device)
        kv = torch.cat((k, v), dim=-1)  # one tensor travels; v's head dim may be smaller than k's (MLA)
        dk = k.shape[-1]
        ring = _Ring(group)
        for step, q_rows, kv_rows, causal in _ring_steps(rank, cp, length):
            pending = ring.start(kv) if step < cp - 1 else None  # the next block travels while this one computes
            held_k, held_v = kv[:, kv_rows, :, :dk], kv[:, kv_rows, :, dk:]
            result = block.forward(q[:, q_rows].contiguous(), held_k.contiguous(), held_v.contiguous(), causal, scale)
            _merge(out, row_max, row_sum, q_rows, result)
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, row_max, row_sum)
        ctx.group, ctx.scale, ctx.block = group, scale, block
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor):
        q, k, v, out, row_max, row_sum = ctx.saved_tensors
        group, scale, block = ctx.group, ctx.scale, ctx.block
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        length = q.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, dk = torch.cat((k, v), dim=-1), k.shape[-1]
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with the block it belongs to
        ring = _Ring(group)
        for step, q_rows, kv_rows, causal in _ring_steps(rank, cp, length):
            pending = ring.start(kv) if step < cp - 1 else None
            grads = block.backward(
                q[:, q_rows].contiguous(), kv[:, kv_rows, :, :dk].contiguous(), kv[:, kv_rows, :, dk:].contiguous(),
                dout[:, q_rows].contiguous(), out[:, q_rows].contiguous(), row_max[:, :, q_rows].contiguous(),
                row_sum[:, :, q_rows].contiguous(), causal, scale)
            dq[:, q_rows] += grads[0].float()
            dkv[:, kv_rows, :, :dk] += grads[1].float()
            dkv[:, kv_rows, :, dk:] += grads[2].float()
            if pending is not None:
                kv = pending.wait()
            # The gradients follow their block one step on (after the next block has arrived: one exchange in flight
            # per pair of ranks); after the last step this brings each block's gradients home.
            dkv = ring.start(dkv).wait()
        return dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), None, None, None


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
    block = _NPU_BLOCK if why_not_fused_ring(q, k, v) is None else _REFERENCE_BLOCK
    return _MergedBlocks.apply(q, k_before, v_before, k, v, scale, block)


def why_not_fused_ring(q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    """Why ring attention's blocks would run the exact PyTorch block on these inputs; None when they run fused."""
    return _attention.why_not_fused(q, k, v)


class _MergedBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k_before: Tensor, v_before: Tensor, k: Tensor, v: Tensor, scale: float,
                block: _Block) -> Tensor:
        b, length, heads, _ = q.shape
        out = torch.zeros(b, length, heads, v.shape[-1], dtype=torch.float32, device=q.device)
        row_max = torch.full((b, heads, length), float("-inf"), dtype=torch.float32, device=q.device)
        row_sum = torch.zeros(b, heads, length, dtype=torch.float32, device=q.device)
        for keys, values, causal in ((k_before, v_before, False), (k, v, True)):
            _merge(out, row_max, row_sum, slice(None), block.forward(q, keys, values, causal, scale))
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


class _Ring:
    """Send a tensor to the next rank of the group and receive the previous rank's (``start(x).wait()``)."""

    def __init__(self, group: Any) -> None:
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        self.group = group
        self.next, self.previous = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]

    def start(self, x: Tensor) -> "_Exchange":
        x = x.contiguous()
        received = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, self.next, self.group),
                                        dist.P2POp(dist.irecv, received, self.previous, self.group)])
        return _Exchange(works, received, x)


@dataclass
class _Exchange:
    works: list
    received: Tensor
    sent: Tensor  # kept alive until the send completes

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.received


__all__ = ["ContextParallel", "check_ulysses_heads", "ring_attention", "ring_step_attention", "ulysses_attention",
           "why_not_fused_ring"]
