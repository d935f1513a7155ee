"""The LLaMA-2 recipe's memory profile for ``lightning-npu plan`` (the protocol: ``lightning_npu.plan.profile``).

Torch-free: the planner imports it to read a config. The recipe's TransformerBlock is the decoder block
``lightning_npu.plan.decoder`` counts (RMSNorm, grouped-query attention with rotary, fused gate/up SwiGLU, untied
output, fp32 logits: see model.py), so the profile is that decoder at the preset's shape.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_npu.plan import DecoderProfile, ModelShape
from recipes.llama2.config import LLaMAConfig

#: The class the recipe's configs shard and checkpoint by (auto_wrap_policy / activation_checkpointing_policy).
BLOCK_CLASS = "recipes.llama2.model.TransformerBlock"
#: LLaMA2's default preset (module.py), used when a config's model: section names none.
DEFAULT_PRESET = "tiny"


def lightning_npu_memory_profile(model: Mapping[str, Any]) -> DecoderProfile:
    """The profile of the LLaMA2 module a config's ``model:`` section (``preset``, ``config``) builds."""
    preset = str(model.get("preset", DEFAULT_PRESET))
    overrides = model.get("config") or {}
    if not isinstance(overrides, Mapping):
        raise ValueError(f"model.config must be a mapping of LLaMAConfig fields, not {overrides!r}")
    config = LLaMAConfig.from_preset(preset, **dict(overrides))
    return DecoderProfile(ModelShape.of(config), name=f"LLaMA {preset}", block_class=BLOCK_CLASS)
