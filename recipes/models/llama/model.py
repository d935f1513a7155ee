"""The LLaMA decoder (LLaMA-2, and the LLaMA-3 family: see ``config.py``) as a plain ``nn.Module`` on
``lightning_npu.kernels``.

The model knows nothing of devices, parallelism or Lightning: sharding and activation checkpointing
wrap ``TransformerBlock`` from outside. Its layers and trunk are the shared ones of ``recipes/decoder/transformer.py``
and its rotary tables (with LLaMA-3.1's scaling) those of ``recipes/decoder/rotary.py``; this module adds LLaMA's
block.

Parameter names (the recipe's state-dict layout; ``hf_checkpoint.py`` maps them to Hugging Face's)::

    tok_embeddings.weight                      [vocab, dim]
    layers.{i}.attention_norm.weight           [dim]
    layers.{i}.attention.wq.weight             [n_heads * head_dim, dim]
    layers.{i}.attention.wk.weight             [n_kv_heads * head_dim, dim]
    layers.{i}.attention.wv.weight             [n_kv_heads * head_dim, dim]
    layers.{i}.attention.wo.weight             [dim, n_heads * head_dim]
    layers.{i}.ffn_norm.weight                 [dim]
    layers.{i}.feed_forward.w_gate.weight      [ffn_hidden_dim, dim]
    layers.{i}.feed_forward.w_up.weight        [ffn_hidden_dim, dim]
    layers.{i}.feed_forward.w_down.weight      [dim, ffn_hidden_dim]
    norm.weight                                [dim]
    output.weight                              [vocab, dim]  (with tie_embeddings: the tok_embeddings parameter;
                                                              the state dict holds it under both names)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from recipes.decoder.rotary import rotary_cos_sin
from recipes.decoder.transformer import (  # noqa: F401  (KVCache, positions_in_samples: part of this module's API)
    Attention,
    CausalDecoder,
    DecoderBlock,
    FeedForward,
    KVCache,
    RMSNorm,
    positions_in_samples,
)
from recipes.models.llama.config import LLaMAConfig


class TransformerBlock(DecoderBlock):
    """One LLaMA layer: grouped-query attention and the SwiGLU MLP."""

    def __init__(self, config: LLaMAConfig, layer_id: int) -> None:
        attention = Attention(config.dim, config.n_heads, config.n_kv_heads, config.head_dim)
        feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)
        super().__init__(layer_id, config.dim, config.norm_eps, attention, feed_forward)


class LLaMA(CausalDecoder):
    """LLaMA decoder: token ids [batch, seq] -> next-token logits [batch, seq, vocab] (fp32)."""

    def __init__(self, config: LLaMAConfig) -> None:
        super().__init__(config, (TransformerBlock(config, i) for i in range(config.n_layers)))

    def rotary_cos_sin(self, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
        return rotary_cos_sin(self.config, device)
