"""The LLaMA family in Hugging Face ``transformers`` (``LlamaForCausalLM``): the parameter name map, ``config.json``
in and out (rotary settings under the transformers 4 and 5 names), and the layer submodules PEFT adapts. The
directories, shards and conversions themselves are shared: ``recipes/decoder/hf_checkpoint.py``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from recipes.decoder.checkpoint_layout import CheckpointError
from recipes.decoder.hf_checkpoint import (
    HF_EMBEDDING, HF_HEAD, PEFT_DECODER_TARGETS, SWIGLU_ACTIVATIONS, hf_attention_names, hf_decoder_entries,
    hf_decoder_fields, hf_feed_forward_names, rope_from_hf, rope_to_hf,
)
from recipes.models.llama.config import LLaMAConfig

#: The ``config.json`` model types of the family (the first is what exports write).
MODEL_TYPES = ("llama",)
#: LoRA target -> the ``LlamaDecoderLayer`` submodule PEFT adapts (its ``target_modules`` name is the last part).
PEFT_TARGETS = PEFT_DECODER_TARGETS


def hf_name_map(config: LLaMAConfig) -> dict[str, tuple[str, ...]]:
    """Recipe parameter name -> the Hugging Face ``LlamaForCausalLM`` name it is (one each)."""
    names: dict[str, tuple[str, ...]] = {"tok_embeddings.weight": (HF_EMBEDDING,)}
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names.update(
            {
                ours + "attention_norm.weight": (theirs + "input_layernorm.weight",),
                **hf_attention_names(ours + "attention.", theirs + "self_attn."),
                ours + "ffn_norm.weight": (theirs + "post_attention_layernorm.weight",),
                **hf_feed_forward_names(ours + "feed_forward.", theirs + "mlp."),
            }
        )
    names["norm.weight"] = ("model.norm.weight",)
    names["output.weight"] = (HF_HEAD,)
    return names


def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> LLaMAConfig:
    """``LLaMAConfig`` from the fields of an HF ``config.json``; architectures the recipe cannot hold exactly
    (biases, rotary scaling other than "llama3", other activations, head_dim != hidden_size / heads) are refused."""
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type={model_type!r}; the LLaMA family reads {list(MODEL_TYPES)}.")
    if hf_config.get("hidden_act", "silu") not in SWIGLU_ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act={hf_config['hidden_act']!r}; the recipe's MLP is SwiGLU (silu).")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise CheckpointError(f"{source}: {flag}=true; the recipe's projections have no bias.")
    rope_theta, rope_scaling = rope_from_hf(hf_config, source=source)
    fields = hf_decoder_fields(hf_config)
    head_dim, heads, hidden = fields.pop("head_dim"), fields["n_heads"], fields["dim"]
    if head_dim * heads != hidden:
        raise CheckpointError(
            f"{source}: head_dim={head_dim} x num_attention_heads={heads} != hidden_size={hidden}; "
            "the recipe needs head_dim = hidden_size / num_attention_heads."
        )
    return LLaMAConfig(
        **fields,
        ffn_hidden_dim=hf_config["intermediate_size"],
        max_seq_len=hf_config.get("max_position_embeddings", 4096),
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )


def hf_config_dict(
    config: LLaMAConfig, *, dtype: torch.dtype, extra: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to ``LLaMA(config)``. The rotary settings and dtype are
    written under both the transformers 4 and 5 names so either version reads them."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": MODEL_TYPES[0],
        **hf_decoder_entries(config, dtype=dtype),
        "intermediate_size": config.ffn_hidden_dim,
        **rope_to_hf(config),
        "attention_bias": False,
        "mlp_bias": False,
    }
    out.update(extra or {})
    return out
