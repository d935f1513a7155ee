"""The DeepSeek family in Hugging Face ``transformers`` (``DeepseekV3ForCausalLM``, ``DeepseekV2ForCausalLM``): the
parameter name map, the stored layouts (per-expert tensors, FP8 block-quantized weights, multi-token-prediction
layers), ``config.json`` in and out, and the layer submodules PEFT adapts.

The experts are stacked in memory as transformers 5 holds them (``mlp.experts.gate_up_proj`` / ``down_proj``);
downloads and ``save_pretrained`` store one tensor per expert (``mlp.experts.{j}.gate_proj`` ...), read and written
by the state-dict adapter (``recipes/decoder/hf_adapter.py``). The official DeepSeek-V3 weights are FP8
(``float8_e4m3fn``) with one fp32 ``weight_scale_inv`` per 128 x 128 block: the adapter dequantizes them to bf16
block by block as they are read.
Their layer ``num_hidden_layers`` (and beyond) is the multi-token-prediction module: imported as the model's
``mtp_layers`` (``config_from_weights``; layers beyond those: ``dropped_names``), trained with ``mtp_loss_weight``,
exported at the same keys; generation does not run it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Iterable, Mapping, Optional

import torch

from recipes.decoder.checkpoint_layout import CheckpointError
from recipes.decoder.hf_checkpoint import (HF_EMBEDDING, HF_HEAD, SWIGLU_ACTIVATIONS, hf_decoder_entries,
                                           hf_decoder_fields, hf_feed_forward_names)
from recipes.decoder.hf_experts import PEFT_EXPERT_TARGETS
from recipes.models.deepseek.config import ARCHITECTURES, YARN_KEYS, DeepSeekConfig

__all__ = ["FP32_NAMES", "MODEL_TYPES", "PEFT_TARGETS", "config_from_hf", "config_from_weights", "dropped_names",
           "hf_config_dict", "hf_name_map"]

log = logging.getLogger(__name__)

#: The ``config.json`` model types of the family, one per ``DeepSeekConfig.architecture`` (each exports as itself).
MODEL_TYPES = ARCHITECTURES
_HF_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
#: LoRA target -> the decoder layer submodule PEFT adapts (an expert target: the shared stacked parameter).
PEFT_TARGETS = {**{target: f"self_attn.{_ATTENTION[mine]}" for target, mine in (
    ("q", "wq"), ("q_a", "wq_a"), ("q_b", "wq_b"), ("kv_a", "wkv_a"), ("kv_b", "wkv_b"), ("o", "wo"))},
    **PEFT_EXPERT_TARGETS}
#: What transformers keeps in fp32 in a bf16 DeepSeek-V3 (``_keep_in_fp32_modules_strict``): the router.
FP32_NAMES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
#: What DeepSeek's release stores in each MTP layer besides the module: copies of the shared embedding and head.
_MTP_SHARED_COPIES = (".embed_tokens.weight", ".shared_head.head.weight")


def _layer_names(config: DeepSeekConfig, ours: str, theirs: str, moe: bool) -> dict[str, tuple[str, ...]]:
    """The name map of one ``DeepSeekBlock`` at ``ours`` (``"layers.0."``) whose HF layer is at ``theirs``."""
    low_rank = ("wq_a", "q_norm", "wq_b") if config.q_lora_rank is not None else ("wq",)
    names = {ours + "attention_norm.weight": (theirs + "input_layernorm.weight",)}
    for mine in (*low_rank, "wkv_a", "kv_norm", "wkv_b", "wo"):
        names[f"{ours}attention.{mine}.weight"] = (f"{theirs}self_attn.{_ATTENTION[mine]}.weight",)
    names[ours + "ffn_norm.weight"] = (theirs + "post_attention_layernorm.weight",)
    mlp, hf_mlp = ours + "feed_forward.", theirs + "mlp."
    if moe:
        names[mlp + "router.weight"] = (hf_mlp + "gate.weight",)
        if config.architecture == "deepseek_v3":
            names[mlp + "router.expert_bias"] = (hf_mlp + "gate.e_score_correction_bias",)
        names[mlp + "experts.w_gate_up"] = (hf_mlp + "experts.gate_up_proj",)
        names[mlp + "experts.w_down"] = (hf_mlp + "experts.down_proj",)
        if config.n_shared_experts:
            names.update(hf_feed_forward_names(mlp + "shared_expert.", hf_mlp + "shared_experts."))
    else:
        names.update(hf_feed_forward_names(mlp, hf_mlp))
    return names


def hf_name_map(config: DeepSeekConfig) -> dict[str, tuple[str, ...]]:
    """Recipe parameter name -> the Hugging Face (transformers 5) name it is (one each); the multi-token-prediction
    depths as DeepSeek's release stores them, at layers ``n_layers ..`` (``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm`` and a decoder layer's tensors)."""
    names: dict[str, tuple[str, ...]] = {"tok_embeddings.weight": (HF_EMBEDDING,)}
    for i in range(config.n_layers):
        names.update(_layer_names(config, f"layers.{i}.", f"model.layers.{i}.", i in config.moe_layers))
    names["norm.weight"] = ("model.norm.weight",)
    names["output.weight"] = (HF_HEAD,)
    for k in range(config.mtp_layers):
        ours, theirs = f"mtp.{k}.", f"model.layers.{config.n_layers + k}."
        for mine, hf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("norm", "shared_head.norm")):
            names[f"{ours}{mine}.weight"] = (f"{theirs}{hf}.weight",)
        names.update(_layer_names(config, ours + "block.", theirs, True))
    return names


def dropped_names(config: DeepSeekConfig, names: Iterable[str]) -> list[str]:
    """The stored names a model of ``config`` does not read: multi-token-prediction layers beyond
    ``config.mtp_layers`` (logged) and the copies of the shared embedding and head the release keeps in each MTP
    layer."""
    last = config.n_layers + config.mtp_layers
    layers = {name: int(m.group(1)) for name in names if (m := _LAYER.match(name))}
    extra = sorted({layer for layer in layers.values() if layer >= last})
    if extra:
        log.warning("Dropping the multi-token-prediction layer(s) %s of the checkpoint: the model keeps"
                    " mtp_layers=%d of them; generation does not use them.", extra, config.mtp_layers)
    return [name for name, layer in layers.items() if layer >= last or name.endswith(_MTP_SHARED_COPIES)]


def config_from_weights(config: DeepSeekConfig, names: Iterable[str]) -> DeepSeekConfig:
    """``config`` with ``mtp_layers`` the multi-token-prediction layers the checkpoint holds (transformers writes
    ``num_nextn_predict_layers`` 1 by default but saves no MTP layer; DeepSeek's release has layer 61)."""
    if config.architecture != "deepseek_v3":
        return config
    held = {int(m.group(1)) for name in names if (m := _LAYER.match(name)) and name.endswith(".eh_proj.weight")}
    depths = 0
    while config.n_layers + depths in held:
        depths += 1
    return dataclasses.replace(config, mtp_layers=depths)


def _rope_from_hf(hf_config: Mapping[str, Any], source: str) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) as transformers 5 standardises them: ``rope_parameters``, else the older
    ``rope_scaling`` (``type`` for ``rope_type``) and ``rope_theta``; YaRN's length defaults to
    ``max_position_embeddings`` and its factor to max_position_embeddings / that length."""
    rope = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    theta = float(rope.pop("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise CheckpointError(f"{source}: rope_type={rope_type!r}; the DeepSeek family implements 'default' and 'yarn'.")
    rope.setdefault("original_max_position_embeddings", hf_config["max_position_embeddings"])
    if rope.get("factor") is None:
        rope["factor"] = hf_config["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return theta, {key: value for key, value in rope.items() if key in YARN_KEYS}


#: What transformers 5.25's ``DeepseekV3Config`` / ``DeepseekV2Config`` give the keys of the routing and MLA that a
#: config.json may leave out: transformers runs a file without them with these, so the recipe reads them the same.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                    "q_lora_rank": 1536, "first_k_dense_replace": 3, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                    "rope_interleave": True},
    "deepseek_v2": {"n_group": None, "topk_group": None, "routed_scaling_factor": 1.0, "n_shared_experts": 2,
                    "q_lora_rank": 1536, "first_k_dense_replace": 0, "rms_norm_eps": 1e-6, "topk_method": "greedy"},
}


def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> DeepSeekConfig:
    """``DeepSeekConfig`` from the fields of an HF ``config.json`` (``mtp_layers`` 0: the weights say how many,
    ``config_from_weights``); what transformers' model would run differently
    (attention or MLP biases, activations other than silu, grouped key/value heads, V2 top-k methods other than
    greedy and group_limited_greedy) is refused. Like transformers, V3 ignores ``topk_method`` / ``scoring_func``
    and V2 ignores ``norm_topk_prob``."""
    arch = hf_config.get("model_type")
    if arch not in MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type={arch!r}; the DeepSeek family reads {list(MODEL_TYPES)}.")
    if hf_config.get("hidden_act", "silu") not in SWIGLU_ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act={hf_config['hidden_act']!r}; the recipe's MLPs are SwiGLU (silu).")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise CheckpointError(f"{source}: {flag}=true; the recipe's DeepSeek projections have no biases.")
    heads = hf_config["num_attention_heads"]
    if (hf_config.get("num_key_value_heads") or heads) != heads:
        raise CheckpointError(f"{source}: num_key_value_heads={hf_config['num_key_value_heads']} !="
                              f" num_attention_heads={heads}; MLA up-projects one key/value head per query head.")
    defaults = HF_DEFAULTS[arch]

    def read(key: str) -> Any:  # a key the file leaves out is what transformers' config class gives it
        return hf_config[key] if key in hf_config else defaults[key]

    n_group, topk_group = read("n_group") or 1, read("topk_group") or 1
    if arch == "deepseek_v2":
        method = read("topk_method")
        if method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"{source}: topk_method={method!r}; DeepSeek-V2 routes by 'greedy' or"
                                  " 'group_limited_greedy'.")
        if method == "greedy":
            n_group, topk_group = 1, 1
    rope_theta, rope_scaling = _rope_from_hf(hf_config, source)
    try:
        return DeepSeekConfig(
            architecture=arch,
            **{field: value for field, value in hf_decoder_fields(hf_config).items()
               if field not in ("n_kv_heads", "head_dim")},  # MLA: one key/value head per query head, three head dims
            q_lora_rank=read("q_lora_rank"),
            kv_lora_rank=hf_config["kv_lora_rank"],
            qk_nope_head_dim=hf_config["qk_nope_head_dim"],
            qk_rope_head_dim=hf_config["qk_rope_head_dim"],
            v_head_dim=hf_config["v_head_dim"],
            ffn_hidden_dim=hf_config["intermediate_size"],
            n_experts=hf_config.get("n_routed_experts", hf_config.get("num_local_experts")),
            n_shared_experts=read("n_shared_experts") or 0,
            expert_hidden_dim=hf_config["moe_intermediate_size"],
            top_k=hf_config["num_experts_per_tok"],
            n_group=n_group,
            topk_group=topk_group,
            first_k_dense=read("first_k_dense_replace") or 0,
            norm_topk_prob=bool(read("norm_topk_prob")) if arch == "deepseek_v3" else False,
            routed_scaling_factor=float(read("routed_scaling_factor")),
            max_seq_len=hf_config["max_position_embeddings"],
            norm_eps=read("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(read("rope_interleave")) if arch == "deepseek_v3" else True,
        )
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from None


def hf_config_dict(
    config: DeepSeekConfig, *, dtype: torch.dtype, extra: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """The ``config.json`` of the ``*ForCausalLM`` of ``config.architecture`` equal to ``DeepSeek(config)``."""
    v3 = config.architecture == "deepseek_v3"
    scaling = {key: value for key, value in (config.rope_scaling or {}).items() if value is not None}
    rope = {"rope_type": "default", **scaling, "rope_theta": config.rope_theta}
    out: dict[str, Any] = {
        "architectures": [_HF_CLASSES[config.architecture]],
        "model_type": config.architecture,
        **hf_decoder_entries(config, dtype=dtype),
        "head_dim": config.qk_rope_head_dim,  # what transformers sets it to
        "intermediate_size": config.ffn_hidden_dim,
        "moe_intermediate_size": config.expert_hidden_dim,
        "n_routed_experts": config.n_experts,
        "n_shared_experts": config.n_shared_experts,
        "num_experts_per_tok": config.top_k,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "first_k_dense_replace": config.first_k_dense,
        "norm_topk_prob": config.norm_topk_prob,
        "routed_scaling_factor": config.routed_scaling_factor,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "scoring_func": "sigmoid" if v3 else "softmax",
    }
    if v3:
        out.update(rope_interleave=config.rope_interleave, num_nextn_predict_layers=config.mtp_layers,
                   topk_method="noaux_tc")
    else:
        out.update(mlp_bias=False, topk_method="group_limited_greedy" if config.n_group > 1 else "greedy")
    out.update(extra or {})
    return out
