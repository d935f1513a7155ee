"""What the recipe's decoder families share: the RMSNorm layer, the key/value cache, causal grouped-query attention
with rotary embeddings (optionally with query/key/value biases and per-head query/key norms), the SwiGLU MLP, and
``CausalDecoder``, the embedding -> blocks -> norm -> output trunk with its rotary tables, argument checks and
packed-row handling. A family brings its blocks and its rotary rule (``recipes/models/<family>/model.py``).

The modules hold no buffers, so a model can be built on the meta device, sharded, then materialised with
``to_empty()`` + ``reset_parameters()`` on each parameter-owning module.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_npu.kernels import apply_rotary, causal_attention, packed_causal_attention, rms_norm, swiglu
from lightning_npu.parallel import ParallelPlan
from recipes.decoder.layers import Embedding, Linear
from recipes.decoder.tensor_parallel import decoder_parallel_plan

#: Where the LoRA targets of attention sit in a ``DecoderBlock`` (``DecoderFamily.lora_sites`` entries).
ATTENTION_LORA_SITES = {
    "q": ("attention.wq", 0, 1),
    "k": ("attention.wk", 0, 1),
    "v": ("attention.wv", 0, 1),
    "o": ("attention.wo", 0, 1),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel gain (computed in fp32, returned in x's dtype)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, eps=self.eps)


class KVCache:
    """Keys and values of every layer for positions ``[0, capacity)``, for incremental decoding.

    Each layer's tensors are [batch, capacity, n_kv_heads, head_dim] (BSND, like the attention
    kernel), its values ``value_dim`` wide when that is given (MLA: narrower than the keys). ``CausalDecoder.forward(tokens, cache=cache, start_pos=p)`` writes the new tokens' keys/values at
    positions ``p .. p + len - 1`` and attends over ``0 .. p + len - 1``.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        capacity: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        value_dim: Optional[int] = None,
    ) -> None:
        shape = (batch_size, capacity, n_kv_heads, head_dim)
        value_shape = shape if value_dim is None else (*shape[:-1], value_dim)
        self.batch_size = batch_size
        self.capacity = capacity
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(value_shape, device=device, dtype=dtype) for _ in range(n_layers)]

    def check(self, batch_size: int, start_pos: int, seq_len: int) -> None:
        """Raise ``ValueError`` if ``seq_len`` tokens of a batch of ``batch_size`` cannot go at ``start_pos``."""
        if batch_size != self.batch_size:
            raise ValueError(
                f"The KV cache holds batch_size={self.batch_size} but the tokens have batch_size={batch_size}; "
                "make a new cache with model.new_cache(batch_size)."
            )
        if start_pos + seq_len > self.capacity:
            raise ValueError(
                f"The KV cache holds {self.capacity} positions but positions {start_pos}..{start_pos + seq_len - 1} "
                "were requested; make a larger cache with model.new_cache(batch_size, capacity=...)."
            )

    def update(self, layer: int, k: Tensor, v: Tensor, start_pos: int) -> tuple[Tensor, Tensor]:
        """Store ``k``/``v`` [batch, seq, n_kv_heads, head_dim] at ``start_pos``; return every key/value
        up to and including them."""
        end = start_pos + k.shape[1]
        self.keys[layer][:, start_pos:end] = k
        self.values[layer][:, start_pos:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings.

    ``qkv_bias`` gives the query/key/value projections a bias (Qwen2), ``qk_norm_eps`` an RMSNorm over each head's
    channels of the queries and keys, before rotary (Qwen3). With ``cu_seqlens`` (packed rows, see ``CausalDecoder.forward``) the batch is one packed sequence of batch x seq tokens:
    rotary runs on it as a batch of one ([1, T, heads, head_dim], with per-token tables [T, head_dim]) and attention
    is per sample (``packed_causal_attention``, TND), so no token attends to another sample's.

    Under context parallelism (npu_fsdp's ``context_parallel_size``, which sets ``context_parallel``) ``x`` is this
    rank's part of each sequence and attention runs over the whole sequence (``context_parallel.attention``).
    """

    #: Set by npu_fsdp under context parallelism (``lightning_npu.parallel.context.ContextParallel``).
    context_parallel = None

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        qk_norm_eps: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.wq = Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.wk = Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = Linear(n_heads * head_dim, dim)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: Optional[KVCache] = None,
        layer: int = 0,
        start_pos: int = 0,
        cu_seqlens: Optional[list[int]] = None,
    ) -> Tensor:
        if cache is not None and self.context_parallel is not None:
            raise ValueError("Decoding with a KV cache runs without context parallelism; generate outside npu_fsdp.")
        batch, seq, _ = x.shape
        rows, length = (1, batch * seq) if cu_seqlens is not None else (batch, seq)
        # Heads as -1: under tensor parallelism each rank holds n_heads / tp of them (and as many KV heads).
        q = self.wq(x).view(rows, length, -1, self.head_dim)
        k = self.wk(x).view(rows, length, -1, self.head_dim)
        v = self.wv(x).view(rows, length, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v, start_pos)
            # Under autocast q comes out in the autocast dtype while a cache allocated from the
            # parameters is fp32; the fused attention kernel needs one dtype.
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = attend(q, k, v, batch, seq, cu_seqlens=cu_seqlens, context_parallel=self.context_parallel)
        return self.wo(out.reshape(batch, seq, -1))


def attend(q: Tensor, k: Tensor, v: Tensor, batch: int, seq: int, *, cu_seqlens: Optional[list[int]] = None,
           context_parallel: Any = None, scale: Optional[float] = None) -> Tensor:
    """Causal attention of a block's ``q``, ``k``, ``v`` ([rows, length, heads, head_dim], one row of batch x seq
    tokens with ``cu_seqlens``) for an input [batch, seq]: within each sequence, or each packed sample; with
    ``context_parallel`` (this rank's part of each sequence) over the whole sequence
    (``context_parallel.attention``). The output holds ``v``'s head dim."""
    if context_parallel is not None:
        q, k, v = (t.view(batch, seq, *t.shape[2:]) for t in (q, k, v))
        return context_parallel.attention(q, k, v, cu_seqlens=cu_seqlens, scale=scale)
    if cu_seqlens is not None:
        return packed_causal_attention(q[0], k[0], v[0], cu_seqlens, scale=scale)
    return causal_attention(q, k, v, scale=scale)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w_down(silu(x W_gate) * (x W_up))``.

    Gate and up are two layers, not one fused [2 * hidden, dim] matrix, so a tensor-parallel column split gives
    every rank matching gate and up rows (a split of a fused [gate; up] matrix would give rank 0 only gate rows).
    Their outputs are concatenated for ``swiglu`` (one fused ``npu_swiglu`` on NPUs). Checkpoints written with the
    fused ``w_gate_up`` still load: see :func:`split_fused_gate_up`.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w_gate = Linear(dim, hidden_dim)
        self.w_up = Linear(dim, hidden_dim)
        self.w_down = Linear(hidden_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(swiglu(torch.cat((self.w_gate(x), self.w_up(x)), dim=-1)))


#: A tensor of the fused gate/up layer of checkpoints written before ``FeedForward`` held two layers: its weight
#: ([gate rows; up rows]) or a LoRA adapter on one half (``lora_a`` / ``lora_b`` of target ``gate`` or ``up``).
_FUSED_GATE_UP = re.compile(r"^(?P<site>(?:.*\.)?)w_gate_up\.(?:weight|(?P<lora>lora_[ab])\.(?P<target>gate|up)\.weight)$")


def is_fused_gate_up(name: str) -> bool:
    """Whether a state-dict name is one of the fused gate/up layer's (see :func:`split_fused_gate_up`)."""
    return _FUSED_GATE_UP.match(name) is not None


def split_fused_gate_up(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state_dict`` with every fused ``<ffn>.w_gate_up.weight`` [2 * hidden, dim] of an older checkpoint split
    into ``<ffn>.w_gate.weight`` and ``<ffn>.w_up.weight``, and its LoRA adapters (``<ffn>.w_gate_up.lora_a.gate.
    weight`` ...) renamed to the layer they adapt (``<ffn>.w_gate.lora_a.gate.weight``). Everything else, the MoE
    family's stacked ``experts.w_gate_up`` included (no ``.weight``), is kept as it is."""
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        match = _FUSED_GATE_UP.match(name)
        if match is None:
            out[name] = tensor
        elif match["lora"] is None:
            gate, up = tensor.chunk(2, dim=0)
            out[f"{match['site']}w_gate.weight"], out[f"{match['site']}w_up.weight"] = gate, up
        else:
            out[f"{match['site']}w_{match['target']}.{match['lora']}.{match['target']}.weight"] = tensor
    return out


class DecoderBlock(nn.Module):
    """One pre-norm decoder layer (attention then MLP, each with a residual): the unit that FSDP
    wrapping and activation checkpointing target. A family's block class passes its attention and MLP modules
    (``feed_forward(x)`` gives the MLP's output)."""

    def __init__(self, layer_id: int, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = feed_forward

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: Optional[KVCache] = None,
        start_pos: int = 0,
        cu_seqlens: Optional[list[int]] = None,
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, self.layer_id, start_pos, cu_seqlens)
        return h + self.feed_forward(self.ffn_norm(h))


def _holds_a_part_of_each_sequence(blocks: Iterable[nn.Module]) -> bool:
    """Whether the blocks' attention runs under context parallelism (npu_fsdp gives every block's attention its
    ``context_parallel``), so their input is a part of each sequence."""
    first = next(iter(blocks), None)
    return getattr(getattr(first, "attention", None), "context_parallel", None) is not None


def positions_in_samples(cu_seqlens: Sequence[int], device: Optional[torch.device] = None) -> Tensor:
    """Each token's position inside its sample, [cu_seqlens[-1]] int64, for the sample boundaries ``cu_seqlens``."""
    if not cu_seqlens or cu_seqlens[0] != 0 or any(b <= a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])):
        raise ValueError(f"cu_seqlens={list(cu_seqlens)} must start at 0 and rise strictly: the sample boundaries.")
    lengths = torch.tensor([b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    starts = torch.tensor(cu_seqlens[:-1]).repeat_interleave(lengths)
    return (torch.arange(cu_seqlens[-1]) - starts).to(device)


class CausalDecoder(nn.Module):
    """A decoder LM: token ids [batch, seq] -> next-token logits [batch, seq, vocab] (fp32), from the token
    embedding, ``blocks`` (each ``block(h, cos, sin, cache, start_pos, cu_seqlens)``), a final RMSNorm and the
    output projection. A family subclasses it with its blocks and its rotary tables (:meth:`rotary_cos_sin`).

    ``config`` needs ``vocab_size``, ``dim``, ``n_layers``, ``n_kv_heads``, ``head_dim``, ``max_seq_len``,
    ``norm_eps`` and ``tie_embeddings``; ``v_head_dim`` where values are narrower than keys (MLA's cache).

    The positions come in with the input (``position_ids``) wherever the input is a part of each sequence: a
    context-parallel rank's part (``tokens`` and ``position_ids`` sharded alike, ``cu_seqlens`` the whole batch's:
    the logits are this rank's tokens'), or a later pipeline stage's input under sequence parallelism.
    """

    def __init__(self, config: Any, blocks: Iterable[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size)
        self._tie_embeddings()
        # fp32 rotary tables keyed by device; per-dtype casts keyed by (device, dtype). A plain dict,
        # not buffers: buffers would be lost on the meta device and sharded/broadcast needlessly.
        self._rope_cache: dict[tuple, tuple[Tensor, Tensor]] = {}

    def _tie_embeddings(self) -> None:
        """With ``tie_embeddings``, one parameter under two names (the state dict holds both). FSDP2 keeps it in
        the root unit, which holds both modules, and swaps sharded parameters in place, so the tie survives."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse: bool = True):
        # Module._apply replaces parameters whose new tensor type differs (meta -> cpu in to_empty()), each module's
        # separately, which would leave two untied copies: tie again afterwards.
        module = super()._apply(fn, recurse)
        self._tie_embeddings()
        return module

    def reset_parameters(self) -> None:
        """Re-initialise every parameter (the same init each module's own ``reset_parameters`` gives)."""
        for module in self.modules():
            if module is not self and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()

    def parallel_plan(self) -> ParallelPlan:
        """How the model splits over ranks under ``npu_fsdp`` (``lightning_npu.parallel.protocol``): its
        tensor-parallel plan (``recipes/decoder/tensor_parallel.py``), the modules that take part in context
        parallelism and its experts."""
        return decoder_parallel_plan(self)

    def context_parallel_modules(self) -> list[str]:
        """The names of the modules that take part in context parallelism (the attention modules), those whose class
        declares a ``context_parallel`` attribute: what the recipe's ``ParallelPlan`` names."""
        return [name for name, module in self.named_modules() if hasattr(type(module), "context_parallel")]

    def expert_modules(self) -> list[str]:
        """The names of the modules holding experts (none here; ``RoutedDecoder`` has them)."""
        return []

    def new_cache(
        self,
        batch_size: int,
        capacity: Optional[int] = None,
        *,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> KVCache:
        """An empty KV cache for ``capacity`` positions (default ``max_seq_len``) on the model's
        device, in its parameter dtype unless told otherwise."""
        weight = self.tok_embeddings.weight
        capacity = self.config.max_seq_len if capacity is None else capacity
        if capacity > self.config.max_seq_len:
            raise ValueError(
                f"KV cache capacity={capacity} exceeds max_seq_len={self.config.max_seq_len}; "
                f"use at most {self.config.max_seq_len} positions."
            )
        return KVCache(
            self.config.n_layers,
            batch_size,
            capacity,
            self.config.n_kv_heads,
            self.config.head_dim,
            device=weight.device if device is None else device,
            dtype=weight.dtype if dtype is None else dtype,
            value_dim=getattr(self.config, "v_head_dim", None),
        )

    def rotary(self, start_pos: int, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin [seq_len, head_dim] for positions ``start_pos .. start_pos + seq_len - 1``: computed in
        fp32 once per device for ``max_seq_len`` positions, cast once per dtype, then sliced."""
        cos, sin = self._rotary_tables(device, dtype)
        return cos[start_pos : start_pos + seq_len], sin[start_pos : start_pos + seq_len]

    def rotary_at(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin [len(positions), head_dim] for the 1-D ``positions`` (each in ``0 .. max_seq_len - 1``), from
        the same tables as :meth:`rotary`."""
        cos, sin = self._rotary_tables(positions.device, dtype)
        return cos[positions], sin[positions]

    def rotary_cos_sin(self, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
        """fp32 cos/sin [max_seq_len, head_dim] for positions 0 .. max_seq_len - 1 (the family's rotary rule)."""
        raise NotImplementedError(f"{type(self).__name__} must define rotary_cos_sin (its rotary tables)")

    def _rotary_tables(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        key = (device, dtype)
        if key not in self._rope_cache:
            base_key = (device, torch.float32)
            if base_key not in self._rope_cache:
                self._rope_cache[base_key] = self.rotary_cos_sin(device)
            cos, sin = self._rope_cache[base_key]
            self._rope_cache[key] = (cos.to(dtype), sin.to(dtype))
        return self._rope_cache[key]

    def forward(
        self,
        tokens: Tensor,
        *,
        labels: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        start_pos: int = 0,
        cu_seqlens: Optional[Sequence[int] | Tensor] = None,
        position_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """Logits [batch, seq, vocab] in fp32 for ``tokens`` [batch, seq] (int64) at positions
        ``start_pos ..``; with ``labels`` [batch, seq], the loss (``loss``: the mean over the labels that are not
        -100). With ``cache``, earlier positions come from it and the new ones are added.

        Packed rows (several samples per row, as ``sft_data.collate_packed`` gives them): ``cu_seqlens`` are the
        sample boundaries over the batch flattened to batch x seq tokens (``[0, ..., batch * seq]``; a list of ints,
        or an integer tensor, read on the host once), and each sample is attended to alone, with rotary positions
        ``position_ids`` [batch, seq] (by default each sample's positions from 0). Every sample then gets the logits
        it would get run on its own. Without packing, ``position_ids`` (every row's the same) place a part of each
        sequence: a context-parallel rank's, or what a later pipeline stage receives under sequence parallelism.

        As a pipeline stage (``parallel_plan().pipeline``) the parts it does not hold are None: without the embedding
        ``tokens`` are the previous stage's hidden states [batch, seq, dim], and without the head it returns its
        last block's.
        """
        h, cos, sin, bounds = self.embed(tokens, cache, start_pos, cu_seqlens, position_ids)
        for block in self.layers:
            h = block(h, cos, sin, cache, start_pos, bounds)
        if self.output is None:
            return h
        logits = self.logits(h)
        return logits if labels is None else self.loss(logits, labels)

    def loss(self, logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        """The next-token cross-entropy of ``logits`` [batch, seq, vocab] against ``labels`` [batch, seq] (-100 marks a
        token without loss): their mean, or with ``reduction="sum"`` their sum."""
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=reduction)

    def embed(
        self,
        tokens: Tensor,
        cache: Optional[KVCache],
        start_pos: int,
        cu_seqlens: Optional[Sequence[int] | Tensor],
        position_ids: Optional[Tensor],
    ) -> tuple[Tensor, Tensor, Tensor, Optional[list[int]]]:
        """What the blocks take, after checking :meth:`forward`'s arguments: the embedded tokens (on a later pipeline
        stage, ``tokens`` are already hidden states), the rotary cos/sin of their positions and the sample boundaries
        (a list, or None without packing). The positions are ``position_ids`` where given (the input may then be a
        part of each sequence, whose positions only the caller knows), else ``start_pos ..`` or, packed, each
        sample's from 0."""
        if self.tok_embeddings is not None and tokens.dim() != 2:
            raise ValueError(
                f"{type(self).__name__} expects token ids of shape [batch, seq]; got shape {tuple(tokens.shape)}. "
                "Add a batch dimension with tokens.unsqueeze(0)."
            )
        batch = tokens.shape[0]
        if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[0] != batch or (
                self.tok_embeddings is not None and position_ids.shape[1] != tokens.shape[1])):
            raise ValueError(
                f"position_ids have shape {tuple(position_ids.shape)}; they must match tokens {tuple(tokens.shape[:2])}."
            )
        if position_ids is None and _holds_a_part_of_each_sequence(self.layers):
            raise ValueError(
                f"{type(self).__name__}'s attention runs under context parallelism, so tokens are this rank's part of"
                " each sequence, whose positions only the caller knows: pass position_ids=context_parallel.shard("
                "<the whole rows' positions>) (DecoderLM does), or call the model outside npu_fsdp."
            )
        seq = tokens.shape[1] if position_ids is None else position_ids.shape[1]
        if start_pos < 0:
            raise ValueError(f"start_pos={start_pos} must be >= 0.")
        if start_pos and cache is None:
            raise ValueError(
                f"start_pos={start_pos} needs a KV cache holding positions 0..{start_pos - 1}; pass cache=..."
            )
        if start_pos + seq > self.config.max_seq_len:
            raise ValueError(
                f"Sequence of {start_pos + seq} positions (start_pos={start_pos} + {seq} tokens) exceeds "
                f"max_seq_len={self.config.max_seq_len}; shorten the input or build the model with a larger "
                "max_seq_len (rotary embeddings extrapolate poorly beyond the trained length)."
            )
        if cache is not None:
            cache.check(batch, start_pos, seq)
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)  # a later pipeline stage's input
        bounds = None
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("Packed rows (cu_seqlens) are for training and scoring; decode without cu_seqlens.")
            bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
            if position_ids is None and (not bounds or bounds[-1] != batch * seq):
                raise ValueError(
                    f"cu_seqlens={bounds} must end at the token count T={batch * seq} (batch x seq of tokens "
                    f"{(batch, seq)}): they are the sample boundaries over the batch flattened to one sequence."
                )
            if position_ids is None:
                position_ids = positions_in_samples(bounds, device=tokens.device).view(batch, seq)
            cos, sin = self.rotary_at(position_ids.flatten(), h.dtype)
        elif position_ids is not None:  # unpacked rows share one rotary table: row 0's positions, checked to be all's
            if batch > 1 and not torch.equal(position_ids[1:], position_ids[:1].expand(batch - 1, -1)):
                row = 1 + int((position_ids[1:] != position_ids[:1]).any(dim=1).nonzero()[0])
                raise ValueError(
                    f"position_ids of row {row} ({position_ids[row, :8].tolist()}...) differ from row 0's"
                    f" ({position_ids[0, :8].tolist()}...): without cu_seqlens every row is at the same positions (one"
                    " rotary table). Pack rows with positions of their own with cu_seqlens, or give every row the same."
                )
            cos, sin = self.rotary_at(position_ids[0], h.dtype)
        else:
            cos, sin = self.rotary(start_pos, seq, h.device, h.dtype)
        return h, cos, sin, bounds

    def no_loss(self) -> Tensor:
        """A 0-d fp32 zero on the model's device: what an extra loss term is when it is off. A plain tensor, not one
        made from a parameter, which tensor or data parallelism may have made a DTensor (a sum with it would turn
        the loss into one)."""
        return torch.zeros((), device=next(self.parameters()).device)

    def logits(self, h: Tensor) -> Tensor:
        """fp32 next-token logits of the last block's output ``h``."""
        return self.output(self.norm(h)).float()
