"""The MoE family in Hugging Face ``transformers`` (``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
``Qwen3MoeForCausalLM``): the parameter name map, the older per-expert tensor layout, ``config.json`` in and out,
and the layer submodules PEFT adapts.

transformers 5 holds a layer's experts stacked in memory, as the recipe does (``mlp.experts.gate_up_proj``
[E, 2F, dim], gate rows first, and ``mlp.experts.down_proj`` [E, dim, F]): the name map names those. Its
``save_pretrained`` (5.24) still writes one tensor per expert, as transformers 4 did and most downloads are:
``mlp.experts.{j}.gate_proj / up_proj / down_proj`` (Qwen) or ``block_sparse_moe.experts.{j}.w1 / w3 / w2``
(Mixtral, whose MoE module was ``block_sparse_moe``): ``expert_layout``. The state-dict adapter reads either
layout and writes exports as ``save_pretrained`` writes them, which transformers 4 and 5 both load
(``recipes/decoder/hf_adapter.py``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from recipes.decoder.checkpoint_layout import CheckpointError
from recipes.decoder.hf_checkpoint import (
    HF_EMBEDDING, HF_HEAD, PEFT_ATTENTION_TARGETS, SWIGLU_ACTIVATIONS, hf_attention_names, hf_decoder_entries,
    hf_decoder_fields, hf_feed_forward_names,
)
from recipes.decoder.hf_adapter import ExpertLayout
from recipes.decoder.hf_experts import PEFT_EXPERT_TARGETS
from recipes.models.moe.config import MoEConfig

#: The ``config.json`` model types of the family, one per ``MoEConfig.architecture`` (each exports as itself).
MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
_HF_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# transformers' defaults where a config.json leaves a field out (configuration_*.py of 5.24).
_DEFAULT_ROPE_THETA = {"mixtral": 1000000.0, "qwen2_moe": 10000.0, "qwen3_moe": 10000.0}
_DEFAULT_AUX_LOSS_COEF = 0.001
#: LoRA target -> the decoder layer submodule PEFT adapts, or for an expert target the stacked parameter of
#: transformers 5's experts module PEFT adapts.
PEFT_TARGETS = {**PEFT_ATTENTION_TARGETS, **PEFT_EXPERT_TARGETS}
#: How Mixtral checkpoints store an expert: under its MoE module ``block_sparse_moe``, projections w1 / w3 / w2.
MIXTRAL_EXPERT_LAYOUT = ExpertLayout(module=".block_sparse_moe.", projections=("w1", "w3", "w2"))


def hf_name_map(config: MoEConfig) -> dict[str, tuple[str, ...]]:
    """Recipe parameter name -> the Hugging Face (transformers 5) names it is made of (two for a fused dense or
    shared-expert gate/up projection: gate rows first, then up rows)."""
    names: dict[str, tuple[str, ...]] = {"tok_embeddings.weight": (HF_EMBEDDING,)}
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names.update(hf_attention_names(ours + "attention.", theirs + "self_attn.", qkv_bias=config.qkv_bias,
                                        qk_norm=config.qk_norm))
        names[ours + "attention_norm.weight"] = (theirs + "input_layernorm.weight",)
        names[ours + "ffn_norm.weight"] = (theirs + "post_attention_layernorm.weight",)
        mlp, hf_mlp = ours + "feed_forward.", theirs + "mlp."
        if i in config.moe_layers:
            names[mlp + "router.weight"] = (hf_mlp + "gate.weight",)
            names[mlp + "experts.w_gate_up"] = (hf_mlp + "experts.gate_up_proj",)
            names[mlp + "experts.w_down"] = (hf_mlp + "experts.down_proj",)
            if config.shared_expert_hidden_dim:
                names.update(hf_feed_forward_names(mlp + "shared_expert.", hf_mlp + "shared_expert."))
                names[mlp + "shared_expert_gate.weight"] = (hf_mlp + "shared_expert_gate.weight",)
        else:
            names.update(hf_feed_forward_names(mlp, hf_mlp))
    names["norm.weight"] = ("model.norm.weight",)
    names["output.weight"] = (HF_HEAD,)
    return names


def expert_layout(config: MoEConfig) -> ExpertLayout:
    """How checkpoints of ``config``'s architecture store one expert: Mixtral's own layout, else the default."""
    return MIXTRAL_EXPERT_LAYOUT if config.architecture == "mixtral" else ExpertLayout()


def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> MoEConfig:
    """``MoEConfig`` from the fields of an HF ``config.json``; what the recipe's model cannot hold exactly
    (sliding-window attention, rotary scaling, router jitter, activations other than silu, Qwen3-MoE's attention
    biases, which include the output projection's) is refused."""
    arch = hf_config.get("model_type")
    if arch not in MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type={arch!r}; the MoE family reads {list(MODEL_TYPES)}.")
    _refuse_unsupported(hf_config, arch, source)
    fields: dict[str, Any] = dict(
        architecture=arch,
        **hf_decoder_fields(hf_config),
        top_k=hf_config["num_experts_per_tok"],
        max_seq_len=hf_config["max_position_embeddings"],
        norm_eps=hf_config["rms_norm_eps"],
        rope_theta=_rope_theta(hf_config, arch, source),
        router_aux_loss_coef=(
            float(hf_config.get("router_aux_loss_coef", _DEFAULT_AUX_LOSS_COEF))
            if hf_config.get("output_router_logits") else 0.0
        ),
    )
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (its attribute_map), 4 as num_experts.
    n_experts = hf_config.get("num_local_experts", hf_config.get("num_experts"))
    if arch == "mixtral":
        fields.update(n_experts=n_experts, expert_hidden_dim=hf_config["intermediate_size"])
    else:
        fields.update(
            n_experts=n_experts,
            expert_hidden_dim=hf_config["moe_intermediate_size"],
            norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
            dense_layers=list(hf_config.get("mlp_only_layers") or []),
            sparse_step=hf_config.get("decoder_sparse_step", 1),
        )
        if arch == "qwen2_moe":
            fields.update(
                shared_expert_hidden_dim=hf_config["shared_expert_intermediate_size"],
                qkv_bias=bool(hf_config.get("qkv_bias", True)),
            )
    try:
        config = MoEConfig(**fields, dense_hidden_dim=hf_config.get("intermediate_size"))
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from None
    if len(config.moe_layers) == config.n_layers:  # the dense width is then unused: keep the config canonical
        config = MoEConfig(**fields)
    return config


def _refuse_unsupported(hf_config: Mapping[str, Any], arch: str, source: str) -> None:
    if hf_config.get("hidden_act", "silu") not in SWIGLU_ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act={hf_config['hidden_act']!r}; the recipe's MLPs are SwiGLU (silu).")
    if arch == "mixtral" and hf_config.get("sliding_window") is not None:
        raise CheckpointError(
            f"{source}: sliding_window={hf_config['sliding_window']}; the recipe's attention is full causal attention."
            " Set sliding_window to null if the model was trained without it."
        )
    if hf_config.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window=true; the recipe's attention is full causal attention.")
    if hf_config.get("router_jitter_noise"):
        raise CheckpointError(
            f"{source}: router_jitter_noise={hf_config['router_jitter_noise']}; the recipe's router adds no noise."
        )
    if arch == "qwen3_moe" and hf_config.get("attention_bias"):
        raise CheckpointError(
            f"{source}: attention_bias=true; the recipe gives biases to q/k/v only (Qwen2-MoE), not to the output."
        )
    if arch == "qwen2_moe" and not hf_config.get("shared_expert_intermediate_size"):
        raise CheckpointError(f"{source}: shared_expert_intermediate_size must be positive (Qwen2-MoE's shared expert).")


def _rope_theta(hf_config: Mapping[str, Any], arch: str, source: str) -> float:
    """The rotary base: transformers 5 writes it in ``rope_parameters``, older ones as ``rope_theta``; scaled
    rotary embeddings are refused."""
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{source}: rope_type={rope_type!r}; the MoE family implements plain rotary embeddings.")
    return float(rope.get("rope_theta", hf_config.get("rope_theta", _DEFAULT_ROPE_THETA[arch])))


def hf_config_dict(
    config: MoEConfig, *, dtype: torch.dtype, extra: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """The ``config.json`` of the ``*ForCausalLM`` of ``config.architecture`` equal to ``MoE(config)``; the rotary
    base and dtype under both the transformers 4 and 5 names."""
    arch = config.architecture
    if config.router_bias_update_rate:
        raise CheckpointError(
            f"router_bias_update_rate={config.router_bias_update_rate}: this model picks its experts by score plus a"
            f" learned balancing bias, which Hugging Face's {_HF_CLASSES[arch]} has no place for, so an export would"
            " route tokens to other experts. Keep it as a recipe checkpoint (generate.py reads it), or train without"
            " the bias (router_aux_loss_coef balances the load and exports)"
        )
    out: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": arch,
        **hf_decoder_entries(config, dtype=dtype),
        "num_experts_per_tok": config.top_k,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "output_router_logits": config.router_aux_loss_coef > 0,
        "router_aux_loss_coef": config.router_aux_loss_coef or _DEFAULT_AUX_LOSS_COEF,
    }
    if arch == "mixtral":
        out.update(num_local_experts=config.n_experts, intermediate_size=config.expert_hidden_dim,
                   sliding_window=None, router_jitter_noise=0.0)
    else:
        out.update(
            num_experts=config.n_experts,
            moe_intermediate_size=config.expert_hidden_dim,
            intermediate_size=config.dense_hidden_dim or config.expert_hidden_dim,  # read only by dense layers
            norm_topk_prob=config.norm_topk_prob,
            mlp_only_layers=list(config.dense_layers),
            decoder_sparse_step=config.sparse_step,
            use_sliding_window=False,
        )
        if arch == "qwen2_moe":
            out.update(shared_expert_intermediate_size=config.shared_expert_hidden_dim, qkv_bias=config.qkv_bias)
        else:
            out["attention_bias"] = False
    out.update(extra or {})
    return out
