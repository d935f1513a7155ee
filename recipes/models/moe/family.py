"""The MoE family as the shared recipe sees it (registered as ``"moe"`` in ``recipes/families.py``)."""

from recipes.decoder.family import DecoderFamily, HFFormat
from recipes.decoder.transformer import ATTENTION_LORA_SITES
from recipes.models.moe import hf
from recipes.models.moe.config import MoEConfig
from recipes.models.moe.model import MoE

FAMILY = DecoderFamily(
    config_class=MoEConfig,
    model_class=MoE,
    hf=HFFormat.of_module(hf),
    lora_sites=ATTENTION_LORA_SITES,
    # Per-expert adapters on the stacked experts of the MoE layers (not on a shared expert or a dense layer's MLP).
    expert_lora_sites={
        "expert_gate": ("feed_forward.experts", "w_gate_up", 0, 2),
        "expert_up": ("feed_forward.experts", "w_gate_up", 1, 2),
        "expert_down": ("feed_forward.experts", "w_down", 0, 1),
    },
)
