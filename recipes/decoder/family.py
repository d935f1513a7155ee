"""What the shared recipe needs from a model family: ``DecoderFamily``, one per folder under ``recipes/models/``,
registered by name in ``recipes/families.py``.

A family's config class is a dataclass with ``from_preset(name, **overrides)`` (a ``tiny`` preset among them:
``DecoderLM``'s default), ``from_dict`` / ``to_dict`` (what checkpoints store), ``vocab_size``, ``max_seq_len``,
``n_layers``, ``tie_embeddings``, ``num_params(include_embedding)`` and ``flops_per_token(seq_len)`` (a sparse family
also ``active_params(include_embedding)``: the parameters one token runs through, which its FLOPs count; a config
that cannot train under context parallelism ``context_parallel_refusal()``, the reason, else None). Its model
class is built from that config alone and is a causal decoder:
``model(input_ids, cu_seqlens=None, position_ids=None, cache=None, start_pos=0)`` gives logits, ``new_cache(batch,
capacity)`` a key/value cache, ``tok_embeddings`` the input embedding and ``layers`` the blocks (what configs
shard and checkpoint by, and where LoRA adds its adapters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from torch import nn

from recipes.decoder.transformer import ATTENTION_LORA_SITES


@dataclass(frozen=True)
class HFFormat:
    """How a family's models are written in Hugging Face ``transformers``.

    ``model_types``: the ``config.json`` ``model_type`` values the family reads (the first is what it writes).
    ``config_from_hf(hf_config, source=...)``: the family's config from a ``config.json``, refusing what the family
    cannot hold exactly. ``config_dict(config, dtype=..., extra=...)``: the ``config.json`` of an equal HF model.
    ``name_map(config)``: recipe parameter name -> the HF names it is made of, more than one for a fused weight
    (the HF tensors concatenated along dim 0 in that order). ``peft_targets``: LoRA target -> the HF submodule of a
    decoder layer that PEFT adapts for it (``lora_export.py``). ``expert_layout(config)``, when set: how the
    family's checkpoints store one expert (``hf_adapter.ExpertLayout``; its default otherwise).
    ``dropped_names(config, names)``, when set: the stored names among ``names`` a model of ``config`` does not
    read (DeepSeek's multi-token-prediction layers beyond ``mtp_layers``). ``config_from_weights(config, names)``:
    ``config`` completed by what the stored names say. ``fp32_names``: endings of the HF tensor names transformers keeps in fp32 whatever the model's dtype (its
    ``_keep_in_fp32_modules_strict``: DeepSeek-V3's router), left out when a checkpoint's one dtype is worked out.
    """

    model_types: tuple[str, ...]
    config_from_hf: Callable[..., Any]
    config_dict: Callable[..., dict[str, Any]]
    name_map: Callable[[Any], dict[str, tuple[str, ...]]]
    peft_targets: Mapping[str, str]
    expert_layout: Optional[Callable[[Any], Any]] = None
    dropped_names: Optional[Callable[[Any, Any], Any]] = None
    config_from_weights: Optional[Callable[[Any, Any], Any]] = None
    fp32_names: tuple[str, ...] = ()

    @classmethod
    def of_module(cls, hf: Any) -> "HFFormat":
        """The format a family's ``hf.py`` module defines under the conventional names: ``MODEL_TYPES``,
        ``config_from_hf``, ``hf_config_dict``, ``hf_name_map``, ``PEFT_TARGETS`` and optionally
        ``expert_layout``, ``dropped_names``, ``config_from_weights`` and ``FP32_NAMES``."""
        return cls(
            model_types=hf.MODEL_TYPES,
            config_from_hf=hf.config_from_hf,
            config_dict=hf.hf_config_dict,
            name_map=hf.hf_name_map,
            peft_targets=hf.PEFT_TARGETS,
            expert_layout=getattr(hf, "expert_layout", None),
            dropped_names=getattr(hf, "dropped_names", None),
            config_from_weights=getattr(hf, "config_from_weights", None),
            fp32_names=getattr(hf, "FP32_NAMES", ()),
        )


#: Where a LoRA target sits in a block: (the ``Linear``'s module path inside the block, the index of the row block
#: of its weight the target is, how many equal row blocks the weight has: 2 for a fused gate/up, else 1).
LoRASite = tuple[str, int, int]

#: Where an expert LoRA target sits in a block that has experts: (the module path of its experts module (the experts
#: contract of ``lightning_npu.parallel.protocol``) inside the block, the name of the stacked weight
#: [n_experts, rows, in] there, the index of the row block of each expert's weight the target is, how many equal
#: row blocks it has: 2 for a fused gate/up, else 1).
ExpertLoRASite = tuple[str, str, int, int]

#: The LoRA sites of a ``DecoderBlock`` of the shared ``Attention`` and SwiGLU ``FeedForward`` (LLaMA's and Qwen's
#: dense blocks; ``transformer.py``'s attention sites and the MLP's projections).
DENSE_LORA_SITES: Mapping[str, LoRASite] = {
    **ATTENTION_LORA_SITES,
    "gate": ("feed_forward.w_gate", 0, 1),
    "up": ("feed_forward.w_up", 0, 1),
    "down": ("feed_forward.w_down", 0, 1),
}


@dataclass(frozen=True)
class DecoderFamily:
    """A model family: its config and model classes, its Hugging Face format, and where each LoRA target
    (``lora_config.TARGETS``) sits in its blocks: ``lora_sites`` for a projection (one per target it supports),
    ``expert_lora_sites`` for the stacked experts' projections (none for a family without experts)."""

    config_class: type
    model_class: type[nn.Module]
    hf: HFFormat
    lora_sites: Mapping[str, LoRASite]
    expert_lora_sites: Mapping[str, ExpertLoRASite] = field(default_factory=dict)
