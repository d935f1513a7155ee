"""The LLaMA family in Hugging Face ``transformers`` (``LlamaForCausalLM``): the parameter name map, ``config.json``
in and out (rotary settings under the transformers 4 and 5 names), and the layer submodules PEFT adapts. The
directories, shards and conversions themselves are shared: ``recipes/decoder/hf_checkpoint.py``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from recipes.decoder.checkpoint_layout import CheckpointError
from recipes.decoder.hf_checkpoint import (
    HF_EMBEDDING, HF_HEAD, SWIGLU_ACTIVATIONS, hf_attention_names, hf_decoder_entries, hf_decoder_fields,
    hf_feed_forward_names,
)
from recipes.models.llama.config import ROPE_SCALING_KEYS, ROPE_SCALING_TYPE, LLaMAConfig, normalise_rope_scaling

#: The ``config.json`` model types of the family (the first is what exports write).
MODEL_TYPES = ("llama",)
# transformers' rotary base when config.json names none (modeling_rope_utils.py).
DEFAULT_HF_ROPE_THETA = 10000.0
#: LoRA target -> the ``LlamaDecoderLayer`` submodule PEFT adapts (its ``target_modules`` name is the last part).
PEFT_TARGETS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


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


def rope_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) of an HF ``config.json``: transformers 5 writes ``rope_parameters`` (theta and
    the scaling in one mapping), older ones ``rope_theta`` and ``rope_scaling`` (``type`` before ``rope_type``),
    which is what Meta's LLaMA-3.1/3.2 downloads carry; transformers 5 converts those at load, and so does this."""
    rope = dict(hf_config.get("rope_parameters") or {})
    legacy = dict(hf_config.get("rope_scaling") or {})
    if not rope:
        rope = dict(legacy)
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
    theta = float(rope.pop("rope_theta", hf_config.get("rope_theta", DEFAULT_HF_ROPE_THETA)))
    rope_type = rope.pop("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type != ROPE_SCALING_TYPE:
        raise CheckpointError(
            f"{source}: rope_type={rope_type!r}; the recipe implements plain rotary embeddings (rope_type 'default') "
            f"and LLaMA-3.1's {ROPE_SCALING_TYPE!r} scaling."
        )
    top = hf_config.get("original_max_position_embeddings")  # transformers reads it before rope_parameters' own
    if top is not None:
        if rope.setdefault("original_max_position_embeddings", top) != top:
            raise CheckpointError(
                f"{source}: original_max_position_embeddings={top} at the top level but"
                f" {rope['original_max_position_embeddings']} in rope_parameters; transformers takes the top-level"
                " one, so make the two agree (or drop one)"
            )
    try:
        return theta, normalise_rope_scaling({key: rope[key] for key in ROPE_SCALING_KEYS if key in rope})
    except ValueError as error:
        raise CheckpointError(f"{source}: rope_parameters: {error}") from None


def rope_to_hf(config: LLaMAConfig) -> dict[str, Any]:
    """The config.json entries of the rotary embedding: ``rope_parameters`` (transformers 5) and the
    ``rope_theta`` / ``rope_scaling`` pair older transformers read."""
    scaling = dict(config.rope_scaling) if config.rope_scaling is not None else None
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta}
    return {"rope_theta": config.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


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
