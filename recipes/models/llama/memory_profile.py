"""The LLaMA recipe's memory profile for ``lightning-npu plan`` (the protocol: ``lightning_npu.plan.profile``).

Torch-free: the planner imports it to read a config. The recipe's TransformerBlock is the decoder block
``lightning_npu.plan.decoder`` counts (RMSNorm, grouped-query attention with rotary, fused gate/up SwiGLU, fp32
logits: see model.py), so the profile is that decoder at the preset's shape: LLaMA-2's, or the LLaMA-3 family's
(vocabulary 128256, 8 kv heads). With ``tie_embeddings`` (LLaMA-3.2 1B/3B) the root unit holds one
[vocab, dim] matrix where the generic decoder has two. With ``lora`` (validated by the
recipe's own ``LoRAConfig``) the profile is a LoRA run: the base frozen, adapters of the configured rank beside
the targeted projections, which are the decoder's projections of the same names, and with
``lora.base_quantization`` every projection of the blocks is counted at its quantized bytes, as lora.py stores them.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_npu.plan import DecoderProfile, ModelShape
from recipes.decoder.plan_profile import adapters, family_config
from recipes.models.llama.config import LLaMAConfig

#: The class the recipe's configs shard and checkpoint by (auto_wrap_policy / activation_checkpointing_policy).
BLOCK_CLASS = "recipes.models.llama.model.TransformerBlock"


def lightning_npu_memory_profile(model: Mapping[str, Any]) -> DecoderProfile:
    """The profile of the DecoderLM module a config's ``model:`` section (``family``, ``preset``, ``config``,
    ``lora``) builds, for a section of this family."""
    preset, config = family_config(model, __name__, LLaMAConfig)
    return DecoderProfile(ModelShape.of(config), name=f"LLaMA {preset}", block_class=BLOCK_CLASS,
                          adapters=adapters(model.get("lora")), tie_embeddings=config.tie_embeddings)
