"""Context parallelism: causal attention over a sequence split across the ranks of a context-parallel group, by
Ulysses or ring; and how it reaches a model (``apply_context_parallel``: the modules its ``ParallelPlan`` names).

Each rank of the group holds ``1 / cp`` of every sequence (all its layers' activations are that size); attention is
the one place a token needs the others. :class:`ContextParallel` is what a module is given for it: which part of a
sequence this rank holds (:meth:`ContextParallel.shard`, the same rule for token ids, labels and positions), and
attention over the whole sequence from those parts (:meth:`ContextParallel.attention`, BSND in and out, like
:func:`~lightning_npu.kernels.causal_attention`).

- ``"ulysses"`` (DeepSpeed-Ulysses): rank ``i`` holds the ``i``-th contiguous chunk. An all-to-all turns
  [batch, seq / cp, heads, head_dim] into [batch, seq, heads / cp, head_dim]: each rank then runs the causal kernel
  (``causal_attention``, or ``packed_causal_attention`` for packed rows, so npu_fusion_attention BSND / TND with
  sparse_mode 3 on NPUs) on whole sequences for its share of the heads, and a second all-to-all brings the output
  back. Four all-to-alls per layer forward (q, k, v, out); the heads must divide by cp, and key/value heads are
  repeated where cp does not divide them.
- ``"ring"``: the sequence is cut into ``2 cp`` chunks and rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``
  (head-tail: under the causal mask every rank then does the same work). Keys and values travel around the ring
  (``cp - 1`` exchanges, overlapped with the blocks' compute); each block's output is merged into the running one
  through its softmax statistics, and backward sends the key/value gradients around the ring after them. The blocks
  are ``lightning_npu.kernels.blockwise_attention``'s (fused on NPUs). Any head count works; packed rows are refused
  (a sample would cross the chunk boundaries).

Ulysses moves ``4 x`` the layer's q/k/v-sized activations per layer but only inside attention and needs
``heads % cp == 0``; ring moves ``2 (cp - 1) / cp`` of the key/value sequence per layer, overlapped with compute, and
scales past the head count (long contexts: 128k over cp = 8 with 8 KV heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_npu.facts.options import CONTEXT_PARALLEL_ALGOS
from lightning_npu.kernels import attention as _attention
from lightning_npu.kernels._dispatch import note_fallback
from lightning_npu.kernels.blockwise_attention import Block, block_for, merge
from lightning_npu.kernels.packed_attention import packed_causal_attention
from lightning_npu.parallel.all_to_all import all_to_all
from lightning_npu.parallel.protocol import find_modules


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

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """The whole of ``x`` along ``dim`` from every rank's part as :meth:`shard` cut it, in sequence order, on every
        rank: outputs (logits to return from ``predict``); not differentiable."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        if self.algo == "ulysses":
            return torch.cat(parts, dim=dim)
        halves = [part.chunk(2, dim=dim) for part in parts]  # rank r holds chunks r and 2 cp - 1 - r
        return torch.cat([head for head, _ in halves] + [tail for _, tail in reversed(halves)], dim=dim)

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


def _sequence_to_heads(x: Tensor, group: Any, cp: int) -> Tensor:
    """[B, S / cp, H, D] (this rank's chunk, every head) -> [B, S, H / cp, D] (every chunk, this rank's heads)."""
    b, s, h, d = x.shape
    parts = x.view(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp: head group, B, s, H / cp, D]
    gathered = all_to_all(parts, group)  # [cp: source rank = sequence chunk, B, s, H / cp, D]
    return gathered.permute(1, 0, 2, 3, 4).reshape(b, cp * s, h // cp, d)


def _heads_to_sequence(x: Tensor, group: Any, cp: int) -> Tensor:
    """The inverse of :func:`_sequence_to_heads`: [B, S, H / cp, D] -> [B, S / cp, H, D]."""
    b, seq, h, d = x.shape
    parts = x.view(b, cp, seq // cp, h, d).permute(1, 0, 2, 3, 4)  # [cp: sequence chunk, B, s, H / cp, D]
    scattered = all_to_all(parts, group)  # [cp: source rank = head group, B, s, H / cp, D]
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
    block, reason = block_for(q, k, v)
    if reason is not None:
        note_fallback("attention", q, reason)
    return _RingAttention.apply(q, k, v, group, scale, block)


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
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: Any, scale: float, block: Block) -> Tensor:
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
            merge(out, row_max, row_sum, q_rows, result)
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


# ---------------------------------------------------------------- the modules that take part


def apply_context_parallel(root: nn.Module, names: Iterable[str], context_parallel: ContextParallel) -> list[str]:
    """Give ``context_parallel`` to each module of ``root`` that ``names`` names (a ``ParallelPlan``'s
    ``context_parallel``; ``""`` is ``root`` itself) as its ``context_parallel`` attribute; returns the names."""
    modules = find_modules(root, names, "ParallelPlan.context_parallel")
    for _, module in modules:
        module.context_parallel = context_parallel
    return [name for name, _ in modules]


__all__ = ["ContextParallel", "apply_context_parallel", "check_ulysses_heads", "ring_attention", "ulysses_attention"]
