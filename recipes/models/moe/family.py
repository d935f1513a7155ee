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
    # Attention only: the experts are stacked parameters, not Linear layers.
    lora_sites=ATTENTION_LORA_SITES,
)
