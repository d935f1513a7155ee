"""Stacked experts (``recipes/decoder/moe.py``'s ``Experts``) in Hugging Face checkpoints, for every family with MoE
layers: the PEFT targets of the stacked parameters, and the per-expert tensor layout checkpoints store.

transformers 5 holds a layer's experts stacked in memory, as the recipe does (``mlp.experts.gate_up_proj``
[E, 2F, dim], gate rows first, and ``mlp.experts.down_proj`` [E, dim, F]): a family's name map names those. Its
``save_pretrained`` (5.24) still writes one tensor per expert, as transformers 4 did and most downloads are:
``mlp.experts.{j}.gate_proj / up_proj / down_proj`` (Qwen, DeepSeek) or ``w1 / w3 / w2`` (Mixtral).
``stack_experts`` reads either; ``unstack_experts`` writes the names it is given, which transformers 4 and 5 both
load. Where a family's MoE module has another name (Mixtral's ``block_sparse_moe``), its ``hf.py`` renames it.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from recipes.decoder.checkpoint_layout import CheckpointError

#: Expert LoRA target -> the stacked parameter of transformers 5's experts module PEFT adapts (its
#: ``target_parameters``; gate and up share ``gate_up_proj``).
PEFT_EXPERT_TARGETS = {"expert_gate": "mlp.experts.gate_up_proj", "expert_up": "mlp.experts.gate_up_proj",
                       "expert_down": "mlp.experts.down_proj"}
#: The per-expert projections' names (gate, up, down) ``save_pretrained`` writes for most families.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# transformers 4's per-expert tensors: (layer prefix, expert index, projection).
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_GATE, _UP = ("w1", "gate_proj"), ("w3", "up_proj")


def stack_experts(hf_state_dict: dict[str, Tensor], n_experts: int) -> dict[str, Tensor]:
    """A per-expert state dict in the stacked layout: each layer's per-expert projections stacked (gate and up
    concatenated, gate first). A layer whose experts are incomplete (an index missing, or a projection of some
    expert) raises ``CheckpointError`` naming it; a state dict already stacked passes through unchanged."""
    out: dict[str, Tensor] = {}
    per_layer: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name, tensor in hf_state_dict.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        kind = "gate" if projection in _GATE else "up" if projection in _UP else "down"
        per_layer.setdefault(prefix, {}).setdefault(kind, {})[expert] = tensor
    for prefix, kinds in per_layer.items():
        experts = list(range(n_experts))
        for kind in ("gate", "up", "down"):
            held = sorted(kinds.get(kind, {}))
            if held != experts:
                raise CheckpointError(
                    f"The Hugging Face checkpoint holds the {kind} projection of experts {held} in {prefix}, but"
                    f" config.json has {n_experts} experts (0 .. {n_experts - 1}). Is a weight shard missing?"
                )
        gate, up, down = (kinds[kind] for kind in ("gate", "up", "down"))
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat((gate[j], up[j])) for j in experts])
        out[prefix + ".down_proj"] = torch.stack([down[j] for j in experts])
    return out


def unstack_experts(hf_state_dict: dict[str, Tensor],
                    projections: tuple[str, str, str] = EXPERT_PROJECTIONS) -> dict[str, Tensor]:
    """Inverse of ``stack_experts``: each stacked expert tensor split into one tensor per expert (copies:
    safetensors refuses tensors sharing a buffer), named by ``projections`` (gate, up, down)."""
    gate, up, down = projections
    out: dict[str, Tensor] = {}
    for name, tensor in hf_state_dict.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for j, expert in enumerate(tensor):
                gate_rows, up_rows = expert.chunk(2)
                out[f"{prefix}.{j}.{gate}.weight"], out[f"{prefix}.{j}.{up}.weight"] = gate_rows.clone(), up_rows.clone()
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for j, expert in enumerate(tensor):
                out[f"{prefix}.{j}.{down}.weight"] = expert.clone()
        else:
            out[name] = tensor
    return out
