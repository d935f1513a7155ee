"""The Qwen2 / Qwen3 dense decoder (see ``config.py``): the shared attention (with Qwen2's q/k/v biases or Qwen3's
per-head q/k norms, and a free head_dim), SwiGLU MLP and trunk of ``recipes/decoder/transformer.py``, with LLaMA's
rotary rule (``recipes/decoder/rotary.py``).

Parameter names (``hf.py`` maps them to Hugging Face's)::

    tok_embeddings.weight                                   [vocab, dim]
    layers.{i}.attention_norm.weight                        [dim]
    layers.{i}.attention.wq.weight (.bias: qwen2)           [n_heads * head_dim, dim]
    layers.{i}.attention.wk.weight (.bias: qwen2)           [n_kv_heads * head_dim, dim]
    layers.{i}.attention.wv.weight (.bias: qwen2)           [n_kv_heads * head_dim, dim]
    layers.{i}.attention.wo.weight                          [dim, n_heads * head_dim]
    layers.{i}.attention.q_norm.weight, k_norm.weight       [head_dim]  (qwen3)
    layers.{i}.ffn_norm.weight                              [dim]
    layers.{i}.feed_forward.w_gate.weight, w_up.weight      [ffn_hidden_dim, dim]
    layers.{i}.feed_forward.w_down.weight                   [dim, ffn_hidden_dim]
    norm.weight, output.weight                              as LLaMA's (output is tok_embeddings with tie_embeddings)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from recipes.decoder.rotary import rotary_cos_sin
from recipes.decoder.transformer import Attention, CausalDecoder, DecoderBlock, FeedForward
from recipes.models.qwen.config import QwenConfig


class QwenBlock(DecoderBlock):
    """One Qwen layer: grouped-query attention (biases or q/k norms by architecture) and the SwiGLU MLP."""

    def __init__(self, config: QwenConfig, layer_id: int) -> None:
        attention = Attention(
            config.dim, config.n_heads, config.n_kv_heads, config.head_dim, qkv_bias=config.qkv_bias,
            qk_norm_eps=config.norm_eps if config.qk_norm else None,
        )
        super().__init__(layer_id, config.dim, config.norm_eps, attention, FeedForward(config.dim, config.ffn_hidden_dim))


class Qwen(CausalDecoder):
    """Qwen dense decoder: token ids [batch, seq] -> next-token logits [batch, seq, vocab] (fp32)."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__(config, (QwenBlock(config, i) for i in range(config.n_layers)))

    def rotary_cos_sin(self, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
        return rotary_cos_sin(self.config, device)
