"""The Mixture-of-Experts decoder (Mixtral, Qwen2-MoE, Qwen3-MoE: see ``config.py``) as a plain ``nn.Module`` on
``lightning_npu.kernels``: the shared attention, norms and trunk of ``recipes/decoder/transformer.py``, with MoE MLPs.

Its blocks put the shared MoE layers of ``recipes/decoder/moe.py`` (stacked experts on grouped matmuls, the
fp32 router, ``RoutedDecoder``'s balancing and logging) after the shared attention.

Parameter names (``hf.py`` maps them to Hugging Face's)::

    tok_embeddings.weight                                   [vocab, dim]
    layers.{i}.attention_norm.weight                        [dim]
    layers.{i}.attention.wq.weight (.bias with qkv_bias)    [n_heads * head_dim, dim]
    layers.{i}.attention.wk.weight (.bias)                  [n_kv_heads * head_dim, dim]
    layers.{i}.attention.wv.weight (.bias)                  [n_kv_heads * head_dim, dim]
    layers.{i}.attention.wo.weight                          [dim, n_heads * head_dim]
    layers.{i}.attention.q_norm.weight, k_norm.weight       [head_dim]  (qwen3_moe)
    layers.{i}.ffn_norm.weight                              [dim]
  an MoE layer:
    layers.{i}.feed_forward.router.weight                   [n_experts, dim]
    layers.{i}.feed_forward.experts.w_gate_up               [n_experts, 2 * expert_hidden_dim, dim] (gate rows first)
    layers.{i}.feed_forward.experts.w_down                  [n_experts, dim, expert_hidden_dim]
    layers.{i}.feed_forward.shared_expert.w_gate.weight     [shared_expert_hidden_dim, dim]  (with one; w_up too)
    layers.{i}.feed_forward.shared_expert.w_down.weight     [dim, shared_expert_hidden_dim]
    layers.{i}.feed_forward.shared_expert_gate.weight       [1, dim]
  a dense layer:
    layers.{i}.feed_forward.w_gate.weight, w_up.weight      [dense_hidden_dim, dim]
    layers.{i}.feed_forward.w_down.weight                   [dim, dense_hidden_dim]
    norm.weight, output.weight                              as LLaMA's
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_npu.kernels import rotary_tables
from recipes.decoder.moe import MoEFeedForward, RoutedDecoder
from recipes.decoder.transformer import Attention, DecoderBlock, FeedForward
from recipes.models.moe.config import MoEConfig


class MoEBlock(DecoderBlock):
    """One layer: attention (with Qwen2-MoE's qkv biases or Qwen3-MoE's q/k norms), then an MoE or dense MLP."""

    def __init__(self, config: MoEConfig, layer_id: int) -> None:
        attention = Attention(
            config.dim, config.n_heads, config.n_kv_heads, config.head_dim,
            qkv_bias=config.qkv_bias, qk_norm_eps=config.norm_eps if config.qk_norm else None,
        )
        if layer_id in config.moe_layers:
            feed_forward: nn.Module = MoEFeedForward(
                config.dim, config.n_experts, config.expert_hidden_dim, config.routing,
                shared_hidden_dim=config.shared_expert_hidden_dim, balancing_bias=config.router_bias_update_rate > 0,
            )
        else:
            feed_forward = FeedForward(config.dim, config.dense_hidden_dim)
        super().__init__(layer_id, config.dim, config.norm_eps, attention, feed_forward)


class MoE(RoutedDecoder):
    """MoE decoder: token ids [batch, seq] -> next-token logits [batch, seq, vocab] (fp32)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, (MoEBlock(config, i) for i in range(config.n_layers)))

    def rotary_cos_sin(self, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
        return rotary_tables(self.config.max_seq_len, self.config.head_dim, theta=self.config.rope_theta, device=device)
