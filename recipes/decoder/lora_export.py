"""A LoRA checkpoint of the recipe out to Hugging Face: a PEFT adapter, or the merged full model.

A LoRA checkpoint (see ``module.py``) holds the adapters and ``hyper_parameters["lora"]``; its base is
``hyper_parameters["init_from"]``. ``export_peft`` writes ``adapter_config.json`` + ``adapter_model.safetensors``
for ``peft.PeftModel.from_pretrained`` on the HF export of that base (``convert.py to-hf``); the recipe's
adapters map one to one onto PEFT's (each half of the fused gate/up has its own, see ``lora.py``), so only names
change. ``export_merged_hf`` adds ``alpha / rank * B @ A`` to the base and writes a plain HF directory.

Adapters trained on a quantized base (``lora.base_quantization``: int8 or NF4) learned to correct that base, not the
full-precision one: the merged export adds them to the decoded quantized base (what training saw, so its logits are
the recipe's), and the PEFT directory's ``README.md`` says which base they were trained on, since PEFT's
``adapter_config.json`` has no field for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from recipes import families
from recipes.decoder.checkpoint_layout import (
    CheckpointError,
    PathLike,
    config_from_hparams,
    read_model_tensors,
)
from recipes.decoder.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES, recorded_tokenizer, save_hf_checkpoint
from recipes.decoder.lora import AdapterSite, LoRAConfig, adapter_sites, check_adapter_state, merged_state_dict
from recipes.decoder.lora_config import EXPERT_TARGETS

#: PEFT saves adapter keys under the wrapped model's names, without the adapter name ("default").
PEFT_PREFIX = "base_model.model.model.layers."
PEFT_KINDS = {"lora_a": "lora_A", "lora_b": "lora_B"}


def read_lora_checkpoint(path: PathLike) -> tuple[Any, LoRAConfig, dict[str, Tensor], dict[str, Any]]:
    """The model config, LoRA config, adapter tensors and metadata of a LoRA recipe checkpoint (file or sharded
    directory); ``CheckpointError`` if it is not one."""
    metadata, tensors = read_model_tensors(path)
    hparams = metadata.get("hyper_parameters") or {}
    if not hparams.get("lora"):
        raise CheckpointError(
            f"{path} is not a LoRA checkpoint (its hyper_parameters have no 'lora'): it holds the full model. "
            "Use `convert.py to-hf` without --merge-lora for it."
        )
    config = config_from_hparams(hparams, source=str(path))
    lora = LoRAConfig.from_value(hparams["lora"])
    check_adapter_state(tensors, config, lora, source=f"LoRA checkpoint {path}")
    return config, lora, tensors, metadata


def is_lora_checkpoint(path: PathLike) -> bool:
    """Whether the recipe checkpoint at ``path`` was written by a LoRA run (reads its metadata only)."""
    from recipes.decoder.checkpoint_layout import read_recipe_metadata

    return bool((read_recipe_metadata(path).get("hyper_parameters") or {}).get("lora"))


def peft_state_dict(adapters: Mapping[str, Tensor], config: Any, lora: LoRAConfig) -> dict[str, Tensor]:
    """The recipe's adapters under PEFT's names (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``);
    expert adapters as PEFT's LoRA on transformers 5's stacked expert parameters (``_expert_peft_tensors``)."""
    peft_targets = families.of_config(config).hf.peft_targets
    out = {}
    experts: dict[tuple[int, str], list[AdapterSite]] = {}
    for site in adapter_sites(config, lora):
        if site.target in EXPERT_TARGETS:
            experts.setdefault((site.layer, peft_targets[site.target]), []).append(site)
            continue
        for kind, peft_kind in PEFT_KINDS.items():
            key = f"{PEFT_PREFIX}{site.layer}.{peft_targets[site.target]}.{peft_kind}.weight"
            out[key] = adapters[site.name(kind)].contiguous()
    for layer in sorted({layer for layer, _ in experts}):
        # PEFT nests one ParamWrapper per adapted parameter of the experts module, in its parameter order
        # (gate_up_proj, then down_proj): the first is innermost, under one "base_layer." per wrapper around it.
        params = sorted({param for held, param in experts if held == layer}, key=_HF_EXPERT_PARAMS.index)
        for depth, param in enumerate(params):
            module = param.rpartition(".")[0]
            nesting = "base_layer." * (len(params) - 1 - depth)
            a, b = _expert_peft_tensors(experts[(layer, param)], adapters)
            out[f"{PEFT_PREFIX}{layer}.{module}.{nesting}lora_A.weight"] = a
            out[f"{PEFT_PREFIX}{layer}.{module}.{nesting}lora_B.weight"] = b
    return out


#: transformers 5's stacked expert parameters (of a decoder layer), in the experts module's parameter order.
_HF_EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _expert_peft_tensors(sites: list[AdapterSite], adapters: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """PEFT's lora_A [E * r', in] and lora_B [out, r' * E] of one stacked expert parameter [E, out, in], for the
    recipe's adapters of its row blocks (``sites``). PEFT's ParamWrapper reads A as [E, r', in] (expert-major) and
    B as [out, r', E] (expert-minor). One adapter per row block of rank r each is one PEFT adapter of rank
    r' = r x blocks adapted: A stacked over the blocks, B block-diagonal (so its update is exactly the sum)."""
    sites = sorted(sites, key=lambda site: site.block)
    a_parts = [adapters[site.name("lora_a")] for site in sites]
    b_parts = [adapters[site.name("lora_b")] for site in sites]
    n_experts, rows, rank = b_parts[0].shape
    a = torch.cat(a_parts, dim=1)  # [E, r', in]
    b = a.new_zeros(n_experts, rows * sites[0].blocks, rank * len(sites))
    for j, (site, part) in enumerate(zip(sites, b_parts)):
        b[:, site.block * rows:(site.block + 1) * rows, j * rank:(j + 1) * rank] = part
    return a.reshape(-1, a.shape[-1]).contiguous(), b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()


def peft_config(lora: LoRAConfig, config: Any, base: Optional[str] = None) -> dict[str, Any]:
    """``adapter_config.json`` for ``lora`` on the model of ``config``: PEFT's LoRA on a causal LM, scaling
    alpha / r (no rsLoRA), on the HF submodules the family names for the targets. Expert targets become PEFT's
    ``target_parameters`` (transformers 5's stacked experts; PEFT >= 0.17), the fused gate_up_proj with rank and
    alpha doubled (``rank_pattern``, ``alpha_pattern``) when both its halves are adapted; PEFT's LoRA on parameters
    takes no dropout, so ``lora_dropout`` is written 0 then (dropout acts in training only: the adapters' outputs
    are the same)."""
    peft_targets = families.of_config(config).hf.peft_targets
    modules = [peft_targets[t].rpartition(".")[2] for t in lora.targets if t not in EXPERT_TARGETS]
    params = sorted({peft_targets[t] for t in lora.targets if t in EXPERT_TARGETS}, key=_HF_EXPERT_PARAMS.index)
    out = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0 if params else lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    if params:
        out["target_parameters"] = params
        fused = [p for p in params if sum(peft_targets[t] == p for t in lora.targets) > 1]
        out["rank_pattern"] = {p: 2 * lora.rank for p in fused}
        out["alpha_pattern"] = {p: 2 * lora.alpha for p in fused}
    return out


def export_peft(checkpoint: PathLike, out_dir: PathLike) -> Path:
    """LoRA recipe checkpoint -> PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    from safetensors.torch import save_file

    config, lora, adapters, metadata = read_lora_checkpoint(checkpoint)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(peft_state_dict(adapters, config, lora), out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    base = (metadata.get("hyper_parameters") or {}).get("init_from")
    (out_dir / "adapter_config.json").write_text(json.dumps(peft_config(lora, config, base), indent=2) + "\n")
    (out_dir / "README.md").write_text(adapter_readme(lora, base))
    return out_dir


def adapter_readme(lora: LoRAConfig, base: Optional[str]) -> str:
    """The PEFT directory's model card: what the adapters are, and on which base (quantized or not) they trained."""
    lines = [f"# LoRA adapter (rank {lora.rank}, alpha {lora.alpha:g}) on {', '.join(lora.targets)}", "",
             f"Trained with lightning-npu's recipe on the base `{base}`."]
    if lora.base_quantization is not None:
        how = {"int8": "int8, one scale per output channel",
               "nf4": "NF4 (QLoRA's 4-bit NormalFloat, blocks of 64 with absmax scales)"}[lora.base_quantization]
        lines += ["", f"The base was **quantized** during training: every block projection stored {how} and decoded"
                  " per matmul. On the full-precision base these adapters give slightly different outputs; for the"
                  " trained model's exact outputs use `convert.py to-hf --merge-lora`, which adds them to the decoded"
                  " quantized base."]
    return "\n".join(lines) + "\n"


def read_merged(
    checkpoint: PathLike, *, base: Optional[PathLike] = None
) -> tuple[Any, dict[str, Tensor], dict[str, Any]]:
    """The model config, the merged full state dict (base + ``alpha / rank * B @ A``) and the metadata of a LoRA
    recipe checkpoint. The base defaults to the checkpoint's ``init_from``."""
    from recipes.decoder.pretrained import read_pretrained

    config, lora, adapters, metadata = read_lora_checkpoint(checkpoint)
    base = base or (metadata.get("hyper_parameters") or {}).get("init_from")
    if not base:
        raise CheckpointError(
            f"{checkpoint} records no init_from, so its base weights are unknown; pass --base with the base model "
            "(the Hugging Face directory or recipe checkpoint the LoRA run started from)."
        )
    if not Path(base).exists():
        raise FileNotFoundError(
            f"The base of LoRA checkpoint {checkpoint}, {str(base)!r} (its init_from), does not exist; pass --base with"
            " where that model is now (the Hugging Face directory or recipe checkpoint the LoRA run started from)."
        )
    return config, merged_state_dict(read_pretrained(str(base), config), adapters, config, lora), metadata


def export_merged_hf(
    checkpoint: PathLike,
    out_dir: PathLike,
    *,
    base: Optional[PathLike] = None,
    tokenizer_path: Optional[PathLike] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """LoRA recipe checkpoint + its base -> HF directory of the merged model. The base defaults to the
    checkpoint's ``init_from``, the tokenizer to the one the checkpoint records (if it still exists)."""
    config, merged, metadata = read_merged(checkpoint, base=base)
    if tokenizer_path is None:
        tokenizer_path = recorded_tokenizer(checkpoint, metadata)
    return save_hf_checkpoint(config, merged, out_dir, max_shard_bytes=max_shard_bytes, tokenizer_path=tokenizer_path)
