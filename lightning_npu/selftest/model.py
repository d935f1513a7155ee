"""The selftest's model: a small LLaMA-style decoder on ``lightning_npu.kernels``, trained by the training check.

The package cannot use the recipe's LLaMA (dependencies point one way: recipes -> lightning_npu), so this is the
training-only core of that architecture -- pre-norm blocks of RMSNorm, grouped-query attention with rotary
embeddings, and a SwiGLU MLP with fused gate/up weights -- without KV cache, generation or checkpoint names. Its
parameters have the recipe's shapes and layout (``ModelShape.block_shapes`` / ``root_shapes`` in the planner), so
``lightning-npu plan`` estimates it as it estimates the recipe. The recipe could build its model on these blocks.

It follows the pipeline contract of ``lightning_npu.parallel.protocol`` (``parallel_plan().pipeline``, ``forward``
with ``labels``, ``loss(logits, labels, reduction)``), so the pipelined-step check splits it into stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_npu.kernels import apply_rotary, causal_attention, rms_norm, rotary_tables, swiglu
from lightning_npu.parallel import ParallelPlan, PipelineLayout


@dataclass(frozen=True)
class DecoderConfig:
    """The planner's ``ModelShape`` fields (it reads them by name), and the norm's epsilon."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden_dim: int = 352
    max_seq_len: int = 128
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    """One pre-norm decoder layer: the FSDP unit."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.c = c
        q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.attention_norm, self.ffn_norm = RMSNorm(c.dim, c.norm_eps), RMSNorm(c.dim, c.norm_eps)
        self.wq, self.wk, self.wv = (nn.Linear(c.dim, n, bias=False) for n in (q, kv, kv))
        self.wo = nn.Linear(q, c.dim, bias=False)
        self.w_gate_up = nn.Linear(c.dim, 2 * c.ffn_hidden_dim, bias=False)  # gate rows, then up rows
        self.w_down = nn.Linear(c.ffn_hidden_dim, c.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q = apply_rotary(self.wq(h).view(b, s, self.c.n_heads, self.c.head_dim), cos, sin)
        k = apply_rotary(self.wk(h).view(b, s, self.c.n_kv_heads, self.c.head_dim), cos, sin)
        v = self.wv(h).view(b, s, self.c.n_kv_heads, self.c.head_dim)
        x = x + self.wo(causal_attention(q, k, v).reshape(b, s, -1))
        return x + self.w_down(swiglu(self.w_gate_up(self.ffn_norm(x))))


class Decoder(nn.Module):
    """Token ids [batch, seq] -> next-token logits [batch, seq, vocab] in fp32, or with ``labels`` their mean loss."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    def parallel_plan(self) -> ParallelPlan:
        """Its pipeline stages: the embedding with the first, the blocks spread over all, the norm and head with the
        last (without pipeline parallelism npu_fsdp reads nothing from it)."""
        return ParallelPlan(pipeline=PipelineLayout(module="", inputs=("tok_embeddings",), blocks="layers",
                                                    outputs=("norm", "output")))

    def forward(self, x: Tensor, *, labels: Optional[Tensor] = None) -> Tensor:
        """As a pipeline stage the parts it does not hold are None: without the embedding ``x`` is the previous
        stage's hidden states [batch, seq, dim], and without the head it returns its last block's."""
        h = x if self.tok_embeddings is None else self.tok_embeddings(x)
        cos, sin = rotary_tables(h.shape[1], self.c.head_dim, device=h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        if self.output is None:
            return h
        logits = self.output(self.norm(h)).float()
        return logits if labels is None else self.loss(logits, labels)

    def loss(self, logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        """Next-token cross-entropy over every position (the pipeline's last stage calls it with ``"sum"``)."""
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=reduction)
