"""The Qwen recipe's memory profile for ``lightning-npu plan`` (the protocol: ``lightning_npu.plan.profile``).

Torch-free: the planner imports it to read a config. The recipe's ``QwenBlock`` is the decoder block
``lightning_npu.plan.decoder`` counts, with Qwen2's q/k/v biases (``qkv_bias``) or Qwen3's per-head q/k norms
(``qk_norm``) and the free head_dim of the shape; tied embeddings and LoRA as LLaMA's profile counts them.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_npu.plan import DecoderProfile, ModelShape
from recipes.decoder.plan_profile import adapters, family_config
from recipes.models.qwen.config import QwenConfig

#: The class the recipe's configs shard and checkpoint by (auto_wrap_policy / activation_checkpointing_policy).
BLOCK_CLASS = "recipes.models.qwen.model.QwenBlock"


def lightning_npu_memory_profile(model: Mapping[str, Any]) -> DecoderProfile:
    """The profile of the DecoderLM module a config's ``model:`` section (``family: qwen``, ``preset``, ``config``,
    ``lora``) builds."""
    preset, config = family_config(model, __name__, QwenConfig)
    return DecoderProfile(ModelShape.of(config), name=f"Qwen {preset}", block_class=BLOCK_CLASS,
                          adapters=adapters(model.get("lora")), qkv_bias=config.qkv_bias, qk_norm=config.qk_norm,
                          tie_embeddings=config.tie_embeddings)
