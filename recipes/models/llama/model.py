"""The LLaMA decoder (LLaMA-2, and the LLaMA-3 family: see ``config.py``) as a plain ``nn.Module`` on
``lightning_npu.kernels``.

The model knows nothing of devices, parallelism or Lightning: sharding and activation checkpointing
wrap ``TransformerBlock`` from outside. Its layers and trunk are the shared ones of ``recipes/decoder/transformer.py``;
this module adds LLaMA's block and its rotary rule (with LLaMA-3.1's scaling).

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

import math
from typing import Optional

import torch
from torch import Tensor

from lightning_npu.kernels import rotary_tables
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


def rotary_frequencies(config: LLaMAConfig, device: Optional[torch.device] = None) -> Tensor:
    """The rotary inverse frequency of each channel pair [head_dim // 2], fp32: ``rope_theta ** (-2i / head_dim)``,
    then, with ``config.rope_scaling``, LLaMA-3.1's "llama3" rule with L = original_max_position_embeddings:
    wavelengths above L / low_freq_factor are stretched by ``factor``, those below L / high_freq_factor are kept,
    and those between blend the two with weight s = (L / wavelength - low) / (high - low) on the kept one."""
    exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    length = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = ((length / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0 above L / low, 1 below L / high
    return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq


def rotary_cos_sin(config: LLaMAConfig, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin [max_seq_len, head_dim] for positions 0 .. max_seq_len - 1, in the layout ``apply_rotary``
    takes. Unscaled, they are ``lightning_npu.kernels.rotary_tables``'s; that kernel takes a base only, so scaled
    frequencies are turned into tables here, the same way (fp32 angles, both halves)."""
    if config.rope_scaling is None:
        return rotary_tables(config.max_seq_len, config.head_dim, theta=config.rope_theta, device=device)
    positions = torch.arange(config.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, rotary_frequencies(config, device))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class LLaMA(CausalDecoder):
    """LLaMA decoder: token ids [batch, seq] -> next-token logits [batch, seq, vocab] (fp32)."""

    def __init__(self, config: LLaMAConfig) -> None:
        super().__init__(config, (TransformerBlock(config, i) for i in range(config.n_layers)))

    def rotary_cos_sin(self, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
        return rotary_cos_sin(self.config, device)
