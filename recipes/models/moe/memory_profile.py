"""The MoE family's memory profile for ``lightning-npu plan`` (the protocol: ``lightning_npu.plan.profile``): the
shared ``MoEProfile`` (``recipes/decoder/moe_profile.py``) of an ``MoEConfig``. Torch-free: the planner imports it to
read a config."""

from __future__ import annotations

from typing import Any, Mapping

from lightning_npu.plan import ModelShape
from recipes.decoder.moe_profile import MoEProfile
from recipes.decoder.plan_profile import adapters, family_config
from recipes.models.moe.config import MoEConfig

#: The class the recipe's configs shard and checkpoint by (auto_wrap_policy / activation_checkpointing_policy).
BLOCK_CLASS = "recipes.models.moe.model.MoEBlock"


def profile_of(config: MoEConfig, name: str, lora: Any = None) -> MoEProfile:
    """The profile of the recipe's MoE model of ``config`` (``lora``: a config's ``model.lora`` value)."""
    dense = config.dense_layer_indices
    shape = ModelShape(
        vocab_size=config.vocab_size, dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads, ffn_hidden_dim=config.dense_hidden_dim if dense else config.expert_hidden_dim,
        max_seq_len=config.max_seq_len, head_dim=config.head_dim,
    )
    if config.tie_embeddings:
        raise ValueError("model.config.tie_embeddings=true is not planned for MoE models yet; plan with false (an"
                         " upper bound: one more [vocab, dim] matrix)")
    return MoEProfile(
        shape, name=name, block_class=BLOCK_CLASS, adapters=adapters(lora, experts=True),
        qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm, n_experts=config.n_experts, top_k=config.top_k,
        expert_hidden_dim=config.expert_hidden_dim, shared_expert_hidden_dim=config.shared_expert_hidden_dim,
        dense_layers=tuple(dense), norm_topk_prob=config.norm_topk_prob,
        router_aux_loss_coef=config.router_aux_loss_coef,
    )


def lightning_npu_memory_profile(model: Mapping[str, Any]) -> MoEProfile:
    """The profile of the DecoderLM module a config's ``model:`` section (``family: moe``, ``preset``,
    ``config``, ``lora``) builds."""
    preset, config = family_config(model, __name__, MoEConfig)
    return profile_of(config, f"MoE {preset} ({config.n_experts} experts, top-{config.top_k})", model.get("lora"))
