"""The MoE family as the shared recipe sees it (registered as ``"moe"`` in ``recipes/families.py``)."""

from recipes.decoder.family import DecoderFamily, HFFormat
from recipes.decoder.moe import EXPERT_LORA_SITES
from recipes.decoder.transformer import ATTENTION_LORA_SITES
from recipes.models.moe import hf
from recipes.models.moe.config import MoEConfig
from recipes.models.moe.model import MoE

FAMILY = DecoderFamily(
    config_class=MoEConfig,
    model_class=MoE,
    hf=HFFormat.of_module(hf),
    lora_sites=ATTENTION_LORA_SITES,
    expert_lora_sites=EXPERT_LORA_SITES,
)
