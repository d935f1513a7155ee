"""The Qwen dense family in Hugging Face ``transformers`` (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): the
parameter name map, ``config.json`` in and out (the rotary settings as LLaMA's, sliding-window attention refused),
and the layer submodules PEFT adapts."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from recipes.decoder.checkpoint_layout import CheckpointError
from recipes.decoder.hf_checkpoint import (
    HF_EMBEDDING, HF_HEAD, PEFT_DECODER_TARGETS, SWIGLU_ACTIVATIONS, hf_attention_names, hf_decoder_entries,
    hf_decoder_fields, hf_feed_forward_names, rope_from_hf, rope_to_hf,
)
from recipes.models.qwen.config import ARCHITECTURES, QwenConfig

__all__ = ["MODEL_TYPES", "PEFT_TARGETS", "config_from_hf", "hf_config_dict", "hf_name_map", "sliding_layers"]

#: The ``config.json`` model types of the family, one per ``QwenConfig.architecture`` (each exports as itself).
MODEL_TYPES = ARCHITECTURES
#: LoRA target -> the decoder layer submodule PEFT adapts: LLaMA's layer layout.
PEFT_TARGETS = PEFT_DECODER_TARGETS
_HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_name_map(config: QwenConfig) -> dict[str, tuple[str, ...]]:
    """Recipe parameter name -> the Hugging Face name it is (one each)."""
    names: dict[str, tuple[str, ...]] = {"tok_embeddings.weight": (HF_EMBEDDING,)}
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names[ours + "attention_norm.weight"] = (theirs + "input_layernorm.weight",)
        names.update(hf_attention_names(ours + "attention.", theirs + "self_attn.", qkv_bias=config.qkv_bias,
                                        qk_norm=config.qk_norm))
        names[ours + "ffn_norm.weight"] = (theirs + "post_attention_layernorm.weight",)
        names.update(hf_feed_forward_names(ours + "feed_forward.", theirs + "mlp."))
    names["norm.weight"] = ("model.norm.weight",)
    names["output.weight"] = (HF_HEAD,)
    return names


def sliding_layers(hf_config: Mapping[str, Any]) -> list[int]:
    """The layers transformers runs with sliding-window attention: those ``layer_types`` marks
    ``sliding_attention`` (transformers 5 writes it), else, as transformers derives it, layers
    ``max_window_layers`` .. when ``use_sliding_window`` and a ``sliding_window`` are set."""
    n_layers = hf_config["num_hidden_layers"]
    types = hf_config.get("layer_types")
    if types is not None:
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if not hf_config.get("use_sliding_window") or hf_config.get("sliding_window") is None:
        return []
    return list(range(hf_config.get("max_window_layers", 28), n_layers))


#: transformers' ``Qwen3Config`` head width where a config.json gives none (Qwen2's is hidden / heads).
QWEN3_HF_HEAD_DIM = 128

def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> QwenConfig:
    """``QwenConfig`` from the fields of an HF ``config.json``; what the recipe's model cannot hold exactly
    (sliding-window layers, Qwen3's ``attention_bias`` (which includes the output projection's), activations
    other than silu, rotary scaling other than "llama3") is refused."""
    arch = hf_config.get("model_type")
    if arch not in MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type={arch!r}; the Qwen family reads {list(MODEL_TYPES)}.")
    if hf_config.get("hidden_act", "silu") not in SWIGLU_ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act={hf_config['hidden_act']!r}; the recipe's MLP is SwiGLU (silu).")
    if arch == "qwen3" and hf_config.get("attention_bias"):
        raise CheckpointError(
            f"{source}: attention_bias=true; the recipe gives biases to q/k/v only (Qwen2), not to Qwen3's output"
            " projection."
        )
    sliding = sliding_layers(hf_config)
    if sliding:
        raise CheckpointError(
            f"{source}: layers {sliding} use sliding-window attention (sliding_window="
            f"{hf_config.get('sliding_window')}, use_sliding_window={hf_config.get('use_sliding_window')},"
            f" max_window_layers={hf_config.get('max_window_layers')}, layer_types); the recipe's attention is full"
            " causal attention. Set use_sliding_window to false (and layer_types to full_attention) if the model was"
            " trained without it, as the released Qwen2.5 and Qwen3 models were."
        )
    rope_theta, rope_scaling = rope_from_hf(hf_config, source=source)
    fields = hf_decoder_fields(hf_config)
    if arch == "qwen3" and "head_dim" not in hf_config:
        fields["head_dim"] = QWEN3_HF_HEAD_DIM
    try:
        return QwenConfig(
            architecture=arch,
            **fields,
            ffn_hidden_dim=hf_config["intermediate_size"],
            max_seq_len=hf_config.get("max_position_embeddings", 32768),
            norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
        )
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from None


def hf_config_dict(
    config: QwenConfig, *, dtype: torch.dtype, extra: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """The ``config.json`` of the ``*ForCausalLM`` of ``config.architecture`` equal to ``Qwen(config)``: full
    attention in every layer, the rotary settings and dtype under both the transformers 4 and 5 names."""
    out: dict[str, Any] = {
        "architectures": [_HF_CLASSES[config.architecture]],
        "model_type": config.architecture,
        **hf_decoder_entries(config, dtype=dtype),
        "intermediate_size": config.ffn_hidden_dim,
        **rope_to_hf(config),
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * config.n_layers,
    }
    if config.architecture == "qwen3":
        out["attention_bias"] = False
    out.update(extra or {})
    return out
